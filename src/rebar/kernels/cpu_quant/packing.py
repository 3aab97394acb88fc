"""Rearranges quantized weights once, at load time, into the layout the kernels stream through.

Output rows are grouped in tiles of 8 (one AVX2 float lane per row); inside a tile the rows' blocks
of 32 columns are interleaved, so the kernel reads each tile's weights front to back. See
csrc/kernels.h for the exact layout. Pure torch: cheap (well under a second for SmolLM2's 135M
weights) and usable without the compiled extension.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

BLOCK = 32  # columns per activation-quantization block
TILE_ROWS = 8  # output rows per tile
# int4 tiles store their rows in this order, so one 32-byte load holds rows p and p + 4 (see
# csrc/quant_linear.cpp); the kernel's reduction puts row k back in lane k.
INT4_ROW_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)


@dataclass(frozen=True, slots=True)
class PackedInt4:
    """4-bit weights with a scale and an offset per group: w = scale * q + offset, q in 0..15."""

    codes: torch.Tensor  # [num_tiles, num_blocks, 8, 16] uint8: low nibble col j, high nibble col j + 16;
    # the 8 rows of a tile in INT4_ROW_ORDER
    scales: torch.Tensor  # [num_tiles, num_groups, 8] float16 or float32
    offsets: torch.Tensor  # [num_tiles, num_groups, 8], same dtype as scales
    out_features: int
    in_features: int
    group_size: int


@dataclass(frozen=True, slots=True)
class PackedInt8:
    """8-bit symmetric weights with a scale per group: w = scale * q, q in -128..127."""

    codes: torch.Tensor  # [num_tiles, num_blocks, 8, 32] int8 (zero past in_features)
    scales: torch.Tensor  # [num_tiles, num_groups, 8] float16 or float32
    out_features: int
    in_features: int
    group_size: int


def _num_tiles(out_features: int) -> int:
    return -(-out_features // TILE_ROWS)


def _scale_dtype(*tensors: torch.Tensor) -> torch.dtype:
    dtypes = {t.dtype for t in tensors}
    if not dtypes <= {torch.float16, torch.float32}:
        raise ValueError(f"scales and offsets must be float16 or float32, got {sorted(map(str, dtypes))}")
    return dtypes.pop() if len(dtypes) == 1 else torch.float32


def _tile_scales(scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[out, groups] -> [tiles, groups, 8], zero rows past `out`."""
    out_features, num_groups = scales.shape
    padded = F.pad(scales.to(dtype), (0, 0, 0, _num_tiles(out_features) * TILE_ROWS - out_features))
    return padded.reshape(-1, TILE_ROWS, num_groups).transpose(1, 2).contiguous()


def _tile_blocks(codes: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """[out, in] 8-bit codes -> [tiles, num_blocks, 8, 32], zero-padded to whole tiles and blocks."""
    out_features, in_features = codes.shape
    pad_rows = _num_tiles(out_features) * TILE_ROWS - out_features
    padded = F.pad(codes, (0, num_blocks * BLOCK - in_features, 0, pad_rows))
    return padded.reshape(-1, TILE_ROWS, num_blocks, BLOCK).transpose(1, 2).contiguous()


def _pair_columns_16_apart(qweight: torch.Tensor) -> torch.Tensor:
    """[out, in // 2] bytes holding columns (2k, 2k+1) -> [out, in // 32, 16] bytes holding columns
    (j, j + 16) of each block of 32, so the kernel expands a block with one mask and one shift."""
    out_features = qweight.shape[0]
    halves = qweight.reshape(out_features, -1, 2, 8)  # [out, blocks, columns 0-15 | 16-31, 8 bytes]
    low_half, high_half = halves[:, :, 0], halves[:, :, 1]
    paired = torch.empty(*low_half.shape, 2, dtype=torch.uint8)  # [out, blocks, 8, 2]
    paired[..., 0] = (low_half & 0x0F) | (high_half << 4)  # columns 2k and 2k + 16
    paired[..., 1] = (low_half >> 4) | (high_half & 0xF0)  # columns 2k + 1 and 2k + 17
    return paired.reshape(out_features, -1, 16)


def _check_group_size(in_features: int, group_size: int) -> None:
    if group_size <= 0 or group_size % BLOCK or in_features % group_size:
        raise ValueError(
            f"group_size must be a positive multiple of {BLOCK} dividing in_features={in_features}, got {group_size}"
        )


def _check_scales(name: str, scales: torch.Tensor, out_features: int, num_groups: int) -> None:
    if tuple(scales.shape) != (out_features, num_groups):
        raise ValueError(f"{name} must have shape [{out_features}, {num_groups}], got {list(scales.shape)}")


def pack_int4(qweight: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, group_size: int) -> PackedInt4:
    """Pack `qweight` uint8 [out, in // 2] (column 2j in the low nibble, 2j+1 in the high one) with
    `scales` and `offsets` [out, in // group_size], w[o, c] = scales[o, c // g] * q[o, c] + offsets[o, c // g].

    Scales keep their dtype (float16 or float32; mixed dtypes become float32).
    """
    if qweight.dim() != 2 or qweight.dtype != torch.uint8:
        raise ValueError(f"qweight must be uint8 [out, in // 2], got {qweight.dtype} {list(qweight.shape)}")
    out_features, in_features = qweight.shape[0], qweight.shape[1] * 2
    _check_group_size(in_features, group_size)
    num_groups = in_features // group_size
    _check_scales("scales", scales, out_features, num_groups)
    _check_scales("offsets", offsets, out_features, num_groups)
    num_blocks = in_features // BLOCK
    padded = F.pad(_pair_columns_16_apart(qweight), (0, 0, 0, 0, 0, _num_tiles(out_features) * TILE_ROWS - out_features))
    tiles = padded.reshape(-1, TILE_ROWS, num_blocks, 16).transpose(1, 2)  # [tiles, blocks, 8, 16] view
    codes = tiles.index_select(2, torch.tensor(INT4_ROW_ORDER))  # one contiguous copy
    dtype = _scale_dtype(scales, offsets)
    return PackedInt4(
        codes=codes,
        scales=_tile_scales(scales, dtype),
        offsets=_tile_scales(offsets, dtype),
        out_features=out_features,
        in_features=in_features,
        group_size=group_size,
    )


def pack_int8(qweight: torch.Tensor, scales: torch.Tensor, group_size: int) -> PackedInt8:
    """Pack `qweight` int8 [out, in] with `scales` [out, in // group_size], w = scales[o, c // g] * q.

    `group_size` is `in` (one scale per output channel; any `in`) or a multiple of 32 dividing `in`.
    """
    if qweight.dim() != 2 or qweight.dtype != torch.int8 or qweight.shape[1] == 0:
        raise ValueError(f"qweight must be int8 [out, in > 0], got {qweight.dtype} {list(qweight.shape)}")
    out_features, in_features = qweight.shape
    if group_size != in_features:
        _check_group_size(in_features, group_size)
    num_groups = in_features // group_size
    _check_scales("scales", scales, out_features, num_groups)
    num_blocks = -(-in_features // BLOCK)
    return PackedInt8(
        codes=_tile_blocks(qweight, num_blocks),
        scales=_tile_scales(scales, _scale_dtype(scales)),
        out_features=out_features,
        in_features=in_features,
        group_size=group_size,
    )
