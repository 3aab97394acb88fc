"""Quantized drop-ins for nn.Linear and nn.Embedding, and the choice of matmul kernel.

A QuantLinear holds a quantized weight (rebar's own int4 / int8 `QuantizedWeight`, or a GGUF
`BlockWeight` in its file's format) and a short list of kernels, each good up to some number of
rows (tokens in the step). On x86 CPUs with AVX2, rebar's own kernels (`rebar.kernels.cpu_quant`:
int8 activations times 4- to 8-bit weights, exact integer dot products) serve every step of every
format; elsewhere torch's packed int8 /
int4 weight-only kernels serve small steps of rebar's formats; on CUDA, rebar's Triton kernels
(`rebar.kernels.triton_quant_matmul`, dequantizing inside the tile loop) serve every step of
rebar's formats when Triton is installed; a dequantize-then-matmul in the activation dtype takes
the rest. `scripts/bench_quant_kernels.py` and `scripts/bench_cpu_quant.py`
measured the switch points (docs/quantization.md, docs/kernels.md). Every kernel agrees with
`DequantizedMatmul`, the reference that runs on any device.

The small-batch kernels give every row the same bits whatever the batch size (rebar's round each
row's activations on their own; torch's compute in bfloat16), so decode outputs do not depend on
batching.
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from rebar.kernels.best_logits import BestTokens, best_logits
from rebar.weights.block_weight import BlockWeight, DecodedBlocks
from rebar.weights.int_formats import QuantizedWeight, unpack_int4

if TYPE_CHECKING:
    from rebar.kernels.cpu_quant import PackedQuant

# A weight QuantLinear and QuantEmbedding run: rebar's own int4/int8 format or a GGUF block format.
AnyQuantWeight = QuantizedWeight | BlockWeight

# rebar's CPU kernels serve steps of every size (docs/kernels.md): at prefill sizes their int8 dot
# products do twice or more the multiply-adds per instruction of float32 FMA, and they read the
# weights in their own format instead of expanding them.
NATIVE_MAX_ROWS = math.inf
# Largest number of rows for which the packed kernels beat dequantize-then-matmul on CPU
# (measured on SmolLM2's shapes with weights out of cache; see docs/quantization.md).
INT8_PACKED_MAX_ROWS = 8
INT4_PACKED_MAX_ROWS = 32
# Group sizes rebar's Triton kernels take besides a whole row: multiples of their narrowest K tile.
TRITON_MIN_GROUP = 32
# Weights expanded at a time by the dequantize path (4 MiB in float32).
DEQUANT_SLICE_ELEMENTS = 1 << 20
# Weights decoded at a time when a GGUF tensor is repacked for the CPU kernels.
PACK_CHUNK_WEIGHTS = 1 << 22
# torch's CPU int4 kernel needs output channels in multiples of 16 and one of these group sizes.
_INT4_CPU_GROUP_SIZES = (32, 64, 128, 256)
_INT4_CPU_OUT_MULTIPLE = 16


class LinearKernel(Protocol):
    name: str

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...  # [rows, in] -> [rows, out], x.dtype


class DequantizedMatmul:
    """Reference and fallback: expand the weight to the activation dtype, then a dense matmul.

    Large weights are expanded a slice of output channels at a time: a few MiB of scratch that the
    allocator reuses, where a whole vocabulary-sized float copy would be fresh memory on every call
    (page faults cost more than the arithmetic).
    """

    name = "dequant"

    def __init__(self, weight: AnyQuantWeight) -> None:
        self.weight = weight
        self.rows_per_slice = max(16, DEQUANT_SLICE_ELEMENTS // weight.in_features)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if weight.out_features <= self.rows_per_slice:
            return F.linear(x, weight.dequantize(x.dtype))
        out = torch.empty(x.shape[0], weight.out_features, dtype=x.dtype, device=x.device)
        for start in range(0, weight.out_features, self.rows_per_slice):
            end = min(start + self.rows_per_slice, weight.out_features)
            out[:, start:end] = F.linear(x, weight.row_slice(start, end).dequantize(x.dtype))
        return out


class Int8PackedMatmul:
    """torch._weight_int8pack_mm: int8 weights used in place, one bf16 scale per output channel."""

    name = "int8pack"

    def __init__(self, weight: QuantizedWeight) -> None:
        assert weight.bits == 8 and weight.group_size == weight.in_features
        self.qweight = weight.qweight.contiguous()
        self.scales = weight.scales[:, 0].to(torch.bfloat16).contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch._weight_int8pack_mm(x.to(torch.bfloat16), self.qweight, self.scales).to(
            x.dtype
        )


class Int4PackedMatmul:
    """torch._weight_int4pack_mm_for_cpu: codes repacked into its layout, (scale, zero) pairs in
    bf16.

    The kernel decodes `(q - 8) * scale + zero`, so zero = offset + 8 * scale.
    """

    name = "int4pack"

    def __init__(self, weight: QuantizedWeight) -> None:
        assert weight.bits == 4 and weight.offsets is not None
        self.group_size = weight.group_size
        codes = unpack_int4(weight.qweight).to(torch.int32)
        self.packed = torch._convert_weight_to_int4pack_for_cpu(codes, 2)
        scales = weight.scales.float()
        zeros = weight.offsets.float() + 8 * scales
        # [num_groups, out, 2]
        self.scales_and_zeros = (
            torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = torch._weight_int4pack_mm_for_cpu(
            x.to(torch.bfloat16), self.packed, self.group_size, self.scales_and_zeros
        )
        return out.to(x.dtype)


class NativeMatmul:
    """rebar's CPU kernels: the weight repacked once into 8-row tiles (`packed`, which the fused
    decode step reads too), activations rounded to int8 per block of 32."""

    name = "native"

    def __init__(self, weight: AnyQuantWeight) -> None:
        from rebar.kernels import cpu_quant

        self._linear = cpu_quant.linear_packed
        self._best_outputs = cpu_quant.best_outputs
        self.packed: PackedQuant = pack_for_cpu(weight)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._linear(x.float(), self.packed).to(x.dtype)

    def best_outputs(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """For x [rows, in] float32: each row's first largest output of `self(x)` and whether it is
        finite in a row without NaN, without writing the outputs."""
        return self._best_outputs(x, self.packed)


class TritonMatmul:
    """rebar's Triton kernels on rebar's int8 / int4 formats (CUDA): the codes read as stored and
    dequantized inside the tile loop, products accumulated in float32, output in x's dtype."""

    name = "triton"

    def __init__(self, weight: QuantizedWeight) -> None:
        from rebar.kernels import triton_quant_matmul

        self._kernels = triton_quant_matmul
        self.weight = weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if weight.bits == 8:
            return self._kernels.int8_matmul(x, weight.qweight, weight.scales, weight.group_size)
        assert weight.offsets is not None  # int4 is asymmetric
        return self._kernels.int4_matmul(
            x, weight.qweight, weight.scales, weight.offsets, weight.group_size
        )


def has_triton_kernel(weight: AnyQuantWeight, device: torch.device) -> bool:
    """Whether rebar's Triton kernels take `weight` on `device`: rebar's own formats on CUDA with
    Triton installed, grouped by the whole row or by a multiple of the kernels' 32-wide K tile."""
    if device.type != "cuda" or not isinstance(weight, QuantizedWeight):
        return False
    whole_row = weight.group_size == weight.in_features
    if not (whole_row or weight.group_size % TRITON_MIN_GROUP == 0):
        return False
    return importlib.util.find_spec("triton") is not None


def pack_for_cpu(weight: AnyQuantWeight) -> PackedQuant:
    """`weight` in the tiled layout of rebar's CPU kernels, a few MiB of it decoded at a time."""
    from rebar.kernels import cpu_quant

    rows = max(8, PACK_CHUNK_WEIGHTS // weight.in_features // 8 * 8)
    return cpu_quant.pack_in_row_chunks(
        weight.out_features, rows, lambda start, end: _pack_rows(weight.row_slice(start, end))
    )


def _pack_rows(weight: AnyQuantWeight) -> PackedQuant:
    from rebar.kernels import cpu_quant

    if isinstance(weight, BlockWeight):
        packed = _pack_decoded(weight.decode())
        # the chunk's file pages: packing a whole embedding never holds them all
        weight.drop_resident()
        return packed
    if isinstance(weight, QuantizedWeight):
        if weight.bits == 4:
            assert weight.offsets is not None  # int4 is asymmetric
            return cpu_quant.pack_int4(
                weight.qweight, weight.scales, weight.offsets, weight.group_size
            )
        return cpu_quant.pack_int8(weight.qweight, weight.scales, weight.group_size)
    raise TypeError(f"no CPU packing for {type(weight).__name__}")


def _pack_decoded(blocks: DecodedBlocks) -> PackedQuant:
    from rebar.kernels import cpu_quant

    if blocks.kind == "sym":
        return cpu_quant.pack_sym(blocks.codes, blocks.bits, blocks.scales, 32, blocks.zero_point)
    if blocks.kind == "affine":
        return cpu_quant.pack_affine(
            blocks.codes, blocks.bits, blocks.scales, _part(blocks.offsets), 32
        )
    if blocks.kind == "super_affine":
        return cpu_quant.pack_super_affine(
            blocks.codes,
            blocks.bits,
            blocks.scales,
            _part(blocks.offsets),
            _part(blocks.sub_scales),
            _part(blocks.sub_mins),
        )
    return cpu_quant.pack_super_sym(
        blocks.codes, blocks.bits, blocks.scales, _part(blocks.sub_scales), blocks.zero_point
    )


def _part(tensor: torch.Tensor | None) -> torch.Tensor:
    assert tensor is not None, "decode() fills every part of its block kind"
    return tensor


def has_native_kernel(weight: AnyQuantWeight, device: torch.device) -> bool:
    """Whether rebar's CPU kernels take `weight` on `device` (builds the extension on first
    call)."""
    if device.type != "cpu":
        return False
    if isinstance(weight, QuantizedWeight):
        per_channel = weight.bits == 8 and weight.group_size == weight.in_features
        grouped = weight.group_size % 32 == 0 and weight.in_features % weight.group_size == 0
        if not (per_channel or grouped):
            return False
    from rebar.kernels import cpu_quant

    return cpu_quant.available()


@dataclass(frozen=True)
class KernelChoice:
    max_rows: float  # this kernel serves steps of up to this many rows
    kernel: LinearKernel


def has_packed_kernel(weight: AnyQuantWeight, device: torch.device) -> bool:
    """Whether `weight` can run through a small-batch kernel (rebar's or torch's packed) on
    `device`."""
    if device.type != "cpu":
        return False
    if has_native_kernel(weight, device):
        return True
    if isinstance(weight, BlockWeight):
        return False  # torch's packed kernels take only rebar's own layouts
    if weight.bits == 8:
        return weight.group_size == weight.in_features
    return (
        weight.group_size in _INT4_CPU_GROUP_SIZES
        and weight.out_features % _INT4_CPU_OUT_MULTIPLE == 0
    )


def packed_kernel(weight: AnyQuantWeight, device: torch.device) -> KernelChoice | None:
    """The small-batch kernel for `weight` on `device`, with the most rows it should serve, if one
    exists: rebar's CPU kernel where it runs, else torch's packed kernel."""
    if not has_packed_kernel(weight, device):
        return None
    if has_native_kernel(weight, device):
        return KernelChoice(NATIVE_MAX_ROWS, NativeMatmul(weight))
    assert isinstance(weight, QuantizedWeight)
    if weight.bits == 8:
        return KernelChoice(INT8_PACKED_MAX_ROWS, Int8PackedMatmul(weight))
    return KernelChoice(INT4_PACKED_MAX_ROWS, Int4PackedMatmul(weight))


def plan_kernels(weight: AnyQuantWeight, device: torch.device) -> tuple[KernelChoice, ...]:
    """Kernels by increasing row limit; the last one (dequantize-then-matmul, unless the Triton
    kernels serve every step) takes any batch."""
    if has_triton_kernel(weight, device):
        assert isinstance(weight, QuantizedWeight)
        return (KernelChoice(math.inf, TritonMatmul(weight)),)
    packed = packed_kernel(weight, device)
    fallback = KernelChoice(math.inf, DequantizedMatmul(weight))
    if packed is None:
        return (fallback,)
    return (packed,) if packed.max_rows == math.inf else (packed, fallback)


@dataclass(frozen=True)
class NativeOperands:
    """What rebar's CPU kernel multiplies with for one QuantLinear, for code that runs the same
    matmul outside the module (the fused decode step)."""

    packed: PackedQuant  # the weight in the kernels' tiled layout
    bias: torch.Tensor | None  # float32, contiguous
    max_rows: float  # the most rows the linear's own forward sends to this kernel


class QuantLinear(nn.Module):
    """`y = x W^T + b` with W a quantized weight; same call signature as nn.Linear.

    `kernels` overrides the plan (tests and benchmarks pin one kernel this way).
    """

    def __init__(
        self,
        weight: AnyQuantWeight,
        bias: torch.Tensor | None = None,
        kernels: tuple[KernelChoice, ...] | None = None,
    ) -> None:
        super().__init__()
        self.weight_q = weight
        self.in_features = weight.in_features
        self.out_features = weight.out_features
        self.bias = bias
        self.kernels = kernels if kernels is not None else plan_kernels(weight, weight.device)

    @property
    def decode_kernel_name(self) -> str:
        """The kernel that serves this linear's smallest steps (one-token decode rows)."""
        return self.kernels[0].kernel.name

    def native_operands(self) -> NativeOperands | None:
        """The packed weight, float32 bias and row limit of rebar's CPU kernel when it serves this
        linear's smallest steps; None when another kernel does."""
        choice = self.kernels[0]
        if not isinstance(choice.kernel, NativeMatmul):
            return None
        bias = None if self.bias is None else self.bias.detach().float().contiguous()
        return NativeOperands(choice.kernel.packed, bias, choice.max_rows)

    def kernel_for(self, num_rows: int) -> LinearKernel:
        return next(choice.kernel for choice in self.kernels if num_rows <= choice.max_rows)

    def best_outputs(self, x: torch.Tensor) -> BestTokens:
        """Each row's first largest output, as `best_logits(self(x).float())` finds it: on
        rebar's CPU kernel (float32 rows, no bias) without writing the outputs, which on a wide
        vocabulary costs a share of an output head's time."""
        rows = x.reshape(-1, self.in_features)
        kernel = self.kernel_for(rows.shape[0])
        if isinstance(kernel, NativeMatmul) and self.bias is None and rows.dtype == torch.float32:
            return BestTokens(*kernel.best_outputs(rows))
        return best_logits(self(rows).float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        out = self.kernel_for(rows.shape[0])(rows)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        names = ", ".join(f"{c.kernel.name}<={c.max_rows}" for c in self.kernels)
        return (
            f"in={self.in_features}, out={self.out_features}, "
            f"{self.weight_q.describe()}, kernels=[{names}]"
        )


class QuantEmbedding(nn.Module):
    """nn.Embedding over a quantized weight: looks rows up, then dequantizes only those rows."""

    def __init__(self, weight: AnyQuantWeight, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight_q = weight
        self.dtype = dtype
        self.num_embeddings = weight.out_features
        self.embedding_dim = weight.in_features

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.weight_q.dequantize_rows(ids.reshape(-1), self.dtype)
        return rows.reshape(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.weight_q.describe()}"
