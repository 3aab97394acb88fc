"""Weight-only quantized matmul `y = x @ W^T` as Triton kernels, dequantizing inside the tile loop.

Weight layouts (N output channels, K input channels, G = K // group_size groups per row):

- int8, symmetric: `qweight` int8 [N, K], `scales` [N, G]; w[n, k] = scales[n, k // group_size] * q.
  Per output channel is `group_size == K` (scales [N, 1]).
- int4, asymmetric: `qweight` uint8 [N, K // 2], two values 0..15 per byte: column 2j in the low
  nibble, column 2j + 1 in the high nibble; `scales` and `offsets` [N, G];
  w[n, k] = scales[n, g] * q + offsets[n, g] with g = k // group_size.

Each K tile lies inside one quantization group, so the scale is applied once per tile to the tile's
partial dot product instead of to every weight: for int4,
    sum_k x_k (s q_k + o) = s * sum_k x_k q_k + o * sum_k x_k.
The integer weights convert exactly to x's dtype, products accumulate in fp32, and the output is
written in x's dtype. Supported group sizes: K itself, or a multiple of 32 that divides K (every
tile width used is 32, 64 or 128). M, N and K need not be multiples of the tile sizes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Tile widths along K that the configs below use; group_size must be a multiple of the smallest.
_MIN_BLOCK_K = 32
# Read once, at the moment the kernels below are decorated: `triton.jit` makes the same choice then.
_INTERPRETED = triton.knobs.runtime.interpret


def _configs() -> list[triton.Config]:
    if _INTERPRETED:
        # The interpreter runs each program in numpy: one small config, nothing to tune.
        return [triton.Config({"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32})]
    shapes = [  # (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages): small M first (decode)
        (16, 64, 128, 4, 4),
        (16, 128, 64, 4, 4),
        (32, 64, 64, 4, 4),
        (64, 64, 32, 4, 4),
        (64, 128, 64, 4, 3),
        (128, 128, 32, 8, 3),
        (128, 64, 64, 8, 3),
    ]
    return [
        triton.Config(
            {"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k}, num_warps=warps, num_stages=stages
        )
        for m, n, k, warps, stages in shapes
    ]


def _tiles_within_groups(
    configs: list[triton.Config], named_args: dict, **_: object
) -> list[triton.Config]:
    """Keep configs whose K tiles never straddle two quantization groups."""
    group_size, k = named_args["group_size"], named_args["K"]
    return [c for c in configs if group_size >= k or group_size % c.kwargs["BLOCK_K"] == 0]


# group_size is part of the key: which configs are valid depends on it.
_autotune = triton.autotune(
    configs=_configs(),
    key=["M", "N", "K", "group_size"],
    prune_configs_by={"early_config_prune": _tiles_within_groups},
)


def int8_matmul(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, group_size: int
) -> torch.Tensor:
    """x [M, K] @ dequantized(qweight [N, K] int8, scales [N, K // group_size]).T -> [M, N] in
    x.dtype."""
    num_out, num_in = qweight.shape
    _check_common(x, num_in, group_size, scales, num_out)
    if qweight.dtype != torch.int8:
        raise ValueError(f"int8 qweight must be torch.int8, got {qweight.dtype}")
    return _launch(_int8_kernel, x, qweight, scales, scales, num_out, group_size)


def int4_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor,
    group_size: int,
) -> torch.Tensor:
    """x [M, K] @ dequantized(qweight [N, K // 2] packed uint8, scales, offsets [N, K //
    group_size]).T.

    Returns [M, N] in x.dtype.
    """
    num_out, num_in = qweight.shape[0], 2 * qweight.shape[1]
    if qweight.dtype != torch.uint8:
        raise ValueError(
            f"int4 qweight must be torch.uint8 (two values per byte), got {qweight.dtype}"
        )
    if x.shape[-1] % 2:
        raise ValueError(f"int4 needs an even number of input channels, got {x.shape[-1]}")
    _check_common(x, num_in, group_size, scales, num_out)
    if offsets.shape != scales.shape:
        raise ValueError(
            f"offsets shape {tuple(offsets.shape)} must equal scales shape {tuple(scales.shape)}"
        )
    return _launch(_int4_kernel, x, qweight, scales, offsets, num_out, group_size)


def _check_common(
    x: torch.Tensor, num_in: int, group_size: int, scales: torch.Tensor, num_out: int
) -> None:
    if x.dim() != 2 or x.shape[1] != num_in:
        raise ValueError(f"x must be [M, {num_in}], got {tuple(x.shape)}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"x must be float16, bfloat16 or float32, got {x.dtype}")
    if group_size <= 0 or num_in % group_size:
        raise ValueError(f"group_size {group_size} must divide the {num_in} input channels")
    if group_size != num_in and group_size % _MIN_BLOCK_K:
        raise ValueError(
            f"group_size {group_size} must be the input "
            f"width {num_in} or a multiple of {_MIN_BLOCK_K}"
        )
    if scales.shape != (num_out, num_in // group_size):
        raise ValueError(
            f"scales must be [{num_out}, {num_in // group_size}], got {tuple(scales.shape)}"
        )


def _launch(
    kernel: triton.runtime.Autotuner,
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor,  # the int8 kernel ignores it
    num_out: int,
    group_size: int,
) -> torch.Tensor:  # [M, N] in x.dtype
    num_rows, num_in = x.shape
    out = torch.empty(num_rows, num_out, dtype=x.dtype, device=x.device)
    if num_rows == 0 or num_out == 0:
        return out

    def grid(meta: dict) -> tuple[int, int]:
        return (triton.cdiv(num_rows, meta["BLOCK_M"]), triton.cdiv(num_out, meta["BLOCK_N"]))

    kernel[grid](
        x, qweight, scales, offsets, out, num_rows, num_out, num_in, group_size,
        x.stride(0), x.stride(1), qweight.stride(0), qweight.stride(1),
        scales.stride(0), scales.stride(1), offsets.stride(0), offsets.stride(1),
        out.stride(0), out.stride(1),
        DOT_DTYPE=_dot_dtype(x.dtype),
        # fp32 inputs: full-precision products, not TF32, so fp32 callers get fp32 results.
        INPUT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
    )  # fmt: skip
    return out


def _dot_dtype(x_dtype: torch.dtype) -> tl.dtype:
    """Operand type of the tile products: x's own type (fp16/bf16 use the tensor cores).

    Triton's interpreter cannot multiply bfloat16 tiles (it stores them as raw uint16), so there
    bf16 operands are widened to fp32; bf16 values times 4- or 8-bit integers are exact in fp32,
    so the result is the same up to summation order.
    """
    if x_dtype == torch.bfloat16:
        return tl.float32 if _INTERPRETED else tl.bfloat16
    return tl.float16 if x_dtype == torch.float16 else tl.float32


@_autotune
@triton.jit
def _int8_kernel(
    x_ptr, w_ptr, scales_ptr, offsets_ptr, out_ptr, M, N, K, group_size,
    stride_xm, stride_xk, stride_wn, stride_wk,
    stride_sn, stride_sg, stride_on, stride_og,
    stride_ym, stride_yn,
    DOT_DTYPE: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask, col_mask = rows < M, cols < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :] * stride_xk,
                    mask=row_mask[:, None] & k_mask[None, :], other=0.0)  # fmt: skip
        q = tl.load(
            w_ptr + cols[None, :] * stride_wn + ks[:, None] * stride_wk,
            mask=col_mask[None, :] & k_mask[:, None],
            other=0,
        )  # fmt: skip  [BLOCK_K, BLOCK_N]
        scale = tl.load(
            scales_ptr + cols * stride_sn + (k0 // group_size) * stride_sg, mask=col_mask, other=0.0
        )
        partial = tl.dot(x.to(DOT_DTYPE), q.to(DOT_DTYPE), input_precision=INPUT_PRECISION)
        acc += partial * scale.to(tl.float32)[None, :]
    tl.store(out_ptr + rows[:, None] * stride_ym + cols[None, :] * stride_yn,
             acc.to(out_ptr.dtype.element_ty),
             mask=row_mask[:, None] & col_mask[None, :])  # fmt: skip


@_autotune
@triton.jit
def _int4_kernel(
    x_ptr, w_ptr, scales_ptr, offsets_ptr, out_ptr, M, N, K, group_size,
    stride_xm, stride_xk, stride_wn, stride_wk,
    stride_sn, stride_sg, stride_on, stride_og,
    stride_ym, stride_yn,
    DOT_DTYPE: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask, col_mask = rows < M, cols < N
    half = tl.arange(0, BLOCK_K // 2)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        # Byte j of the tile holds input columns 2j (low nibble) and 2j + 1 (high nibble): split x
        # into its even and odd columns instead of interleaving the unpacked weights.
        even = k0 + 2 * half
        pair_mask = even < K  # K is even, so the odd partner exists whenever the even one does
        x_mask = row_mask[:, None] & pair_mask[None, :]
        x_even = tl.load(
            x_ptr + rows[:, None] * stride_xm + even[None, :] * stride_xk, mask=x_mask, other=0.0
        )
        x_odd = tl.load(
            x_ptr + rows[:, None] * stride_xm + (even + 1)[None, :] * stride_xk,
            mask=x_mask,
            other=0.0,
        )
        packed = tl.load(
            w_ptr + cols[None, :] * stride_wn + (k0 // 2 + half)[:, None] * stride_wk,
            mask=col_mask[None, :] & pair_mask[:, None],
            other=0,
        )  # fmt: skip  [BLOCK_K // 2, BLOCK_N]
        low = (packed & 0xF).to(DOT_DTYPE)
        high = (packed >> 4).to(DOT_DTYPE)
        partial = tl.dot(x_even.to(DOT_DTYPE), low, input_precision=INPUT_PRECISION)
        partial = tl.dot(x_odd.to(DOT_DTYPE), high, acc=partial, input_precision=INPUT_PRECISION)
        row_sums = tl.sum(x_even.to(tl.float32), axis=1) + tl.sum(x_odd.to(tl.float32), axis=1)

        group = k0 // group_size
        scale = tl.load(scales_ptr + cols * stride_sn + group * stride_sg, mask=col_mask, other=0.0)
        offset = tl.load(
            offsets_ptr + cols * stride_on + group * stride_og, mask=col_mask, other=0.0
        )
        acc += (
            partial * scale.to(tl.float32)[None, :]
            + row_sums[:, None] * offset.to(tl.float32)[None, :]
        )
    tl.store(out_ptr + rows[:, None] * stride_ym + cols[None, :] * stride_yn,
             acc.to(out_ptr.dtype.element_ty),
             mask=row_mask[:, None] & col_mask[None, :])  # fmt: skip
