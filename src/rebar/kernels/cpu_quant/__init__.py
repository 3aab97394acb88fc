"""Quantized-weight linear layers for x86 CPUs: y = x @ w.T with w in one of GGUF's block formats.

Each activation row is quantized to int8 per block of 32 values (one float scale per block), and
each weight block's dot product with it is computed exactly in integers, with AVX-512 VNNI or
AVX-VNNI dot-product instructions where the CPU has them and AVX2 byte multiply-adds otherwise, in
the manner of llama.cpp's quantized dot products; per-block sums are then scaled in float32.
Compared with float math on the dequantized weights, the result therefore carries the activation
rounding error: at most sum_c |w[o, c]| * d_x(c) / 2 per output, d_x = max|x_block| / 127.

Weights are rearranged once by a `pack_*` function (cheap, pure torch) into a `PackedQuant` and
multiplied with `linear_packed`, the decode-time path; the kinds (packing.WeightKind) cover GGUF's
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K exactly, and rebar's own int4 / int8 checkpoints,
every one at any number of rows.
`int4_linear` / `int8_linear` take rebar's raw layouts and pack on every call: for tests and
one-off use.

The C++ extension is compiled on first use (a minute or so on 2 cores, once per machine and
instruction set: cached in torch's extension directory, `TORCH_EXTENSIONS_DIR` when set).
`available()` says whether it can be used; it is False on CPUs without AVX2/FMA/F16C, without a C++
compiler or ninja, when the build fails, or when the environment sets `REBAR_DISABLE_CPU_KERNELS=1`
(read once, at first use). The linear functions then raise `CpuKernelsUnavailable`, so callers
check `available()` and keep a torch path. `isa()` names the dot-product instruction set in use.
Threads: as many as `torch.get_num_threads()`.
"""

from __future__ import annotations

import torch

from rebar.kernels.cpu_quant.build import DISABLE_ENV, ISA_ENV, load_extension
from rebar.kernels.cpu_quant.packing import (
    PackedQuant,
    WeightKind,
    pack_affine,
    pack_in_row_chunks,
    pack_int4,
    pack_int8,
    pack_super_affine,
    pack_super_sym,
    pack_sym,
)

__all__ = [
    "DISABLE_ENV",
    "ISA_ENV",
    "CpuKernelsUnavailable",
    "PackedQuant",
    "WeightKind",
    "available",
    "best_outputs",
    "int4_linear",
    "int8_linear",
    "isa",
    "linear_packed",
    "pack_affine",
    "pack_in_row_chunks",
    "pack_int4",
    "pack_int8",
    "pack_super_affine",
    "pack_super_sym",
    "pack_sym",
    "quantize_activations",
]


class CpuKernelsUnavailable(RuntimeError):
    """The compiled kernels cannot run in this process; the message says why."""


def available() -> bool:
    """True when the extension is built (building it now if needed) and loaded. Never raises."""
    try:
        return load_extension().module is not None
    except Exception:
        return False


def _extension():
    result = load_extension()
    if result.module is None:
        raise CpuKernelsUnavailable(f"rebar CPU quantized kernels are unavailable: {result.reason}")
    return result.module


def isa() -> str:
    """The integer dot-product instruction set the kernels were built for ("avx512-vnni", "avx-vnni"
    or "avx2")."""
    return _extension().isa()


def linear_packed(x: torch.Tensor, packed: PackedQuant) -> torch.Tensor:
    """x [..., in] float32 -> [..., out] float32 = x @ w.T for a weight packed by a `pack_*`
    function.

    Raises ValueError for a wrong dtype, device or width of x.
    """
    return _extension().linear_packed(x, packed.kernel_args())


def best_outputs(x: torch.Tensor, packed: PackedQuant) -> tuple[torch.Tensor, torch.Tensor]:
    """For x [rows, in] float32: what `best_logits(linear_packed(x, packed))` returns (each row's
    first largest output, and whether it is finite in a row without NaN), computed without writing
    the [rows, out] outputs.

    Raises ValueError for a wrong dtype, device, shape or width of x.
    """
    return _extension().best_outputs(x, packed.kernel_args())


def int4_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor,
    group_size: int,
) -> torch.Tensor:
    """x @ w.T with w[o, c] = scales[o, c // g] * q[o, c] + offsets[o, c // g] (layout:
    `pack_int4`).

    Packs the weights on every call; pack once and use `linear_packed` on a hot path.
    """
    _extension()  # fail on an unusable extension before spending time packing
    return linear_packed(x, pack_int4(qweight, scales, offsets, group_size))


def int8_linear(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, group_size: int
) -> torch.Tensor:
    """x @ w.T with w[o, c] = scales[o, c // g] * q[o, c] (layout: `pack_int8`).

    Packs the weights on every call; pack once and use `linear_packed` on a hot path.
    """
    _extension()
    return linear_packed(x, pack_int8(qweight, scales, group_size))


def quantize_activations(
    x: torch.Tensor, group_size: int | None = None, half_scales: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The activations exactly as the kernels see them: x [rows, in] float32 ->
    (q int8 [rows, blocks * 32] zero-padded, d float32 [rows, blocks], group sums float32
    [rows, in // group_size] or None, sums of q over each half-block int32 [rows, blocks * 2]), with
    x ~= q * d per block of 32. With `half_scales` (what the kernels do for the weights whose
    `PackedQuant.half_activation_scales` is true), d and the group sums' per-block terms are
    rounded to float16, as llama.cpp's Q8_0 / Q8_1 activation blocks hold them."""
    blocks_per_sum = 0 if group_size is None else group_size // 32
    return _extension().quantize_activations(x, blocks_per_sum, half_scales)
