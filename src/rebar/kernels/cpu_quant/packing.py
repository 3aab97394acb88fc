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
# int4 codes of one tile and block are stored as 4 chunks of 32 bytes: byte 4 * row + j of chunk c
# holds the codes of columns 4c + j (low nibble) and 16 + 4c + j (high nibble) of that row, so the
# kernel's integer sums land in one lane per output row (see csrc/quant_linear.cpp).
INT4_CHUNKS = 4

@dataclass(frozen=True, slots=True)
class PackedInt4:
    """4-bit weights with a scale and an offset per group: w = scale * q + offset, q in 0..15."""

    codes: torch.Tensor  # [num_tiles, num_blocks, 4, 32] uint8: chunk c, byte 4 * row + j holds columns
    # 4c + j (low nibble) and 16 + 4c + j (high nibble)
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


def _interleave_int4_tiles(qweight: torch.Tensor, num_tiles: int) -> torch.Tensor:
    """[out, in // 2] bytes holding columns (2k, 2k+1) -> [tiles, blocks, 4, 32] in the kernel's layout."""
    out_features = qweight.shape[0]
    codes = torch.stack((qweight & 0x0F, qweight >> 4), dim=-1).reshape(out_features, -1)  # [out, in]
    codes = F.pad(codes, (0, 0, 0, num_tiles * TILE_ROWS - out_features))
    # [tiles, row, block, half (cols 0-15 | 16-31), chunk, j] -> [tiles, block, chunk, row, j]
    split = codes.reshape(num_tiles, TILE_ROWS, -1, 2, INT4_CHUNKS, 4).permute(0, 2, 3, 4, 1, 5)
    return (split[:, :, 0] | (split[:, :, 1] << 4)).reshape(num_tiles, -1, INT4_CHUNKS, TILE_ROWS * 4).contiguous()


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
    codes = _interleave_int4_tiles(qweight, _num_tiles(out_features))
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
