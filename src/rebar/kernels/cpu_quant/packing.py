"""Rearranges quantized weights once, at load time, into the layout the kernels stream through.

Output rows are grouped in tiles of 8 (one AVX2 float lane per row); inside a tile the rows' blocks
of 32 columns are interleaved, so the kernel reads each tile's weights front to back. See
csrc/kernels.h for the weight kinds and the exact layout. Pure torch: cheap (well under a second for
SmolLM2's 135M weights) and usable without the compiled extension.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from enum import IntEnum

import torch
import torch.nn.functional as F

from rebar.kernels.cpu_quant.weight_memory import ARENA

BLOCK = 32  # columns per activation-quantization block
TILE_ROWS = 8  # output rows per tile
CODE_VECTORS = 8  # per tile and block: code vector k holds columns 4k..4k+3 of the tile's 8 rows
SUPER_BLOCK = 256  # columns per super-block of the K-quant kinds


class WeightKind(IntEnum):
    """The kernels' weight kinds (csrc/kernels.h), one per family of exactly mapped GGUF types."""

    SYM = 0  # w = scale[g] * (q - zero_point) (Q4_0, Q5_0, Q8_0 and rebar int8 as q + 128)
    AFFINE = 1  # w = scale[g] * q + offset[g] (Q4_1, Q5_1, rebar int4)
    SUPER_AFFINE = 2  # w = d * sc[b] * q - dmin * m[b] (Q4_K, Q5_K)
    SUPER_SYM = 3  # w = d * sc[h] * (q - zero_point), sc per 16 columns (Q6_K)


@dataclass(frozen=True, slots=True)
class PackedQuant:
    """A weight `[out_features, in_features]` in the kernels' tiled layout.

    `codes`: `[tiles, blocks, code_bits, 32]` uint8 (four chunks of nibbles, then `code_bits - 4`
    vectors of high bits; 8-bit codes a byte each; every code is unsigned). `scales` (and
    `offsets`) `[tiles, groups, 8]`, with `group_size` columns per group (a super-block's 256 for
    the super kinds, whose `scales` / `offsets` are float16 d / dmin). `sub_scales`: SUPER_AFFINE's
    6-bit scale and min pairs packed `[tiles, groups, 96]`, SUPER_SYM's int8 `[tiles, groups, 16,
    8]`.
    """

    kind: WeightKind
    code_bits: int
    codes: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor | None
    sub_scales: torch.Tensor | None
    zero_point: int
    out_features: int
    in_features: int
    group_size: int

    @property
    def half_activation_scales(self) -> bool:
        """Whether the kernels round this weight's activation block scales to float16 (kernels.h):
        the kinds llama.cpp multiplies by Q8_0 / Q8_1 blocks, not the K-quants' float32 Q8_K."""
        return self.kind in (WeightKind.SYM, WeightKind.AFFINE)

    def kernel_args(self) -> tuple:
        """The weight as the compiled kernels take it (bindings.cpp's WeightArgs)."""
        return (
            int(self.kind),
            self.code_bits,
            self.codes,
            self.scales,
            self.offsets,
            self.sub_scales,
            self.zero_point,
            self.out_features,
            self.in_features,
        )

    @property
    def num_bytes(self) -> int:
        parts = [self.codes, self.scales, self.offsets, self.sub_scales]
        return sum(t.numel() * t.element_size() for t in parts if t is not None)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight `[out, in]` these codes stand for (tests; the reference of the
        kernels)."""
        return _dequantize_packed(self).to(dtype)


def _num_tiles(out_features: int) -> int:
    return -(-out_features // TILE_ROWS)


def _scale_dtype(*tensors: torch.Tensor) -> torch.dtype:
    dtypes = {t.dtype for t in tensors}
    if not dtypes <= {torch.float16, torch.float32}:
        raise ValueError(
            f"scales and offsets must be float16 or float32, got {sorted(map(str, dtypes))}"
        )
    return dtypes.pop() if len(dtypes) == 1 else torch.float32


def _pad_rows(t: torch.Tensor, out_features: int) -> torch.Tensor:
    pad = _num_tiles(out_features) * TILE_ROWS - out_features
    return F.pad(t, (0, 0, 0, pad)) if pad else t


def _tile_scales(scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[out, groups] -> [tiles, groups, 8], zero rows past `out`."""
    out_features, num_groups = scales.shape
    padded = _pad_rows(scales.to(dtype), out_features)
    return padded.reshape(-1, TILE_ROWS, num_groups).transpose(1, 2).contiguous()


def _tile_sub_scales(values: torch.Tensor, num_groups: int) -> torch.Tensor:
    """[out, groups * subs] 8-bit -> [tiles, groups, subs, 8], zero rows past `out`."""
    out_features = values.shape[0]
    padded = _pad_rows(values, out_features)
    return (
        padded.reshape(-1, TILE_ROWS, num_groups, values.shape[1] // num_groups)
        .permute(0, 2, 3, 1)
        .contiguous()
    )


def tile_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned codes uint8 `[out, in]` (`in` a multiple of 32, values < 2^bits, bits 4, 5, 6 or 8)
    -> `[tiles, blocks, bits, 32]`: four chunks of nibbles, then `bits - 4` vectors of high bits;
    8-bit codes are the 8 code vectors themselves (a byte per code, nothing to unpack).

    Byte `4 * row + j` of code vector k is the code of column `4k + j` of that row; chunk c holds
    code vectors c (low nibble) and 4 + c (high nibble); the e = bits - 4 high bits of code vector k
    sit in high vector `k // (8 // e)` at bit `e * (k % (8 // e))`.
    """
    if bits not in (4, 5, 6, 8):
        raise ValueError(f"codes have 4, 5, 6 or 8 bits, got {bits}")
    out_features, in_features = codes.shape
    if in_features % BLOCK:
        raise ValueError(f"in_features {in_features} is not a multiple of {BLOCK}")
    num_tiles = _num_tiles(out_features)
    padded = _pad_rows(codes.to(torch.uint8), out_features)
    # [tiles, row, block, k, j] -> [tiles, block, k, row, j] -> code vectors [tiles, blocks, 8, 32]
    vectors = padded.reshape(num_tiles, TILE_ROWS, -1, CODE_VECTORS, 4).permute(0, 2, 3, 1, 4)
    vectors = vectors.reshape(num_tiles, -1, CODE_VECTORS, TILE_ROWS * 4)
    if bits == 8:
        return vectors.contiguous()
    low = vectors & 0x0F
    parts = [low[:, :, :4] | (low[:, :, 4:] << 4)]
    extra = bits - 4
    if extra:
        per_vector = CODE_VECTORS // extra
        high = (vectors >> 4) & ((1 << extra) - 1)
        for v in range(extra):
            plane = torch.zeros_like(high[:, :, 0])
            for k in range(v * per_vector, (v + 1) * per_vector):
                plane |= high[:, :, k] << (extra * (k % per_vector))
            parts.append(plane.unsqueeze(2))
    return torch.cat(parts, dim=2).contiguous()


def untile_codes(codes: torch.Tensor, bits: int, out_features: int) -> torch.Tensor:
    """Inverse of `tile_codes`: `[tiles, blocks, bits, 32]` -> uint8 `[out, in]`."""
    num_tiles, num_blocks = codes.shape[:2]
    if bits == 8:  # the code vectors as they are
        vectors = codes
    else:
        chunks = codes[:, :, :4]
        vectors = torch.cat([chunks & 0x0F, chunks >> 4], dim=2)  # [tiles, blocks, 8, 32]
    extra = bits - 4
    if 0 < extra < 4:
        per_vector = CODE_VECTORS // extra
        for k in range(CODE_VECTORS):
            plane = codes[:, :, 4 + k // per_vector]
            vectors[:, :, k] |= ((plane >> (extra * (k % per_vector))) & ((1 << extra) - 1)) << 4
    values = vectors.reshape(num_tiles, num_blocks, CODE_VECTORS, TILE_ROWS, 4).permute(
        0, 3, 1, 2, 4
    )
    return values.reshape(num_tiles * TILE_ROWS, num_blocks * BLOCK)[:out_features]


def _check_group_size(in_features: int, group_size: int) -> None:
    if group_size <= 0 or group_size % BLOCK or in_features % group_size:
        raise ValueError(
            f"group_size must be a positive multiple of {BLOCK} "
            f"dividing in_features={in_features}, got {group_size}"
        )


def _check_shape(name: str, t: torch.Tensor, shape: tuple[int, int]) -> None:
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(t.shape)}")


def pack_affine(
    codes: torch.Tensor, bits: int, scales: torch.Tensor, offsets: torch.Tensor, group_size: int
) -> PackedQuant:
    """Unsigned `codes` uint8 `[out, in]` (4 or 5 bits) with `scales`, `offsets` `[out, in //
    group_size]`: w[o, c] = scales[o, c // g] * q[o, c] + offsets[o, c // g]. Scales keep their
    dtype (float16 or float32; mixed dtypes become float32)."""
    if codes.dim() != 2 or bits not in (4, 5):
        raise ValueError(
            f"affine codes must be 2-D with 4 or 5 bits, got {list(codes.shape)}, {bits} bits"
        )
    out_features, in_features = codes.shape
    _check_group_size(in_features, group_size)
    num_groups = in_features // group_size
    _check_shape("scales", scales, (out_features, num_groups))
    _check_shape("offsets", offsets, (out_features, num_groups))
    dtype = _scale_dtype(scales, offsets)
    return PackedQuant(
        WeightKind.AFFINE,
        bits,
        tile_codes(codes, bits),
        _tile_scales(scales, dtype),
        _tile_scales(offsets, dtype),
        None,
        0,
        out_features,
        in_features,
        group_size,
    )


def pack_int4(
    qweight: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, group_size: int
) -> PackedQuant:
    """rebar's int4 layout: `qweight` uint8 [out, in // 2] (column 2j in the low nibble, 2j+1 in the
    high one) with `scales` and `offsets` [out, in // group_size]."""
    if qweight.dim() != 2 or qweight.dtype != torch.uint8:
        raise ValueError(
            f"qweight must be uint8 [out, in // 2], got {qweight.dtype} {list(qweight.shape)}"
        )
    codes = torch.stack((qweight & 0x0F, qweight >> 4), dim=-1).reshape(qweight.shape[0], -1)
    return pack_affine(codes, 4, scales, offsets, group_size)


def pack_super_affine(
    codes: torch.Tensor,
    bits: int,
    d: torch.Tensor,
    dmin: torch.Tensor,
    sub_scales: torch.Tensor,
    sub_mins: torch.Tensor,
) -> PackedQuant:
    """Q4_K / Q5_K: w = d[o, s] * sc[o, b] * q - dmin[o, s] * m[o, b], with `d`, `dmin` float16
    `[out, in // 256]` per super-block s and `sub_scales`, `sub_mins` uint8 `[out, in // 32]` per
    block b."""
    out_features, in_features = codes.shape
    _check_group_size(in_features, SUPER_BLOCK)
    num_groups = in_features // SUPER_BLOCK
    for name, t in (("d", d), ("dmin", dmin)):
        _check_shape(name, t, (out_features, num_groups))
    for name, t in (("sub_scales", sub_scales), ("sub_mins", sub_mins)):
        _check_shape(name, t, (out_features, in_features // BLOCK))
    if int(sub_scales.max()) >= 64 or int(sub_mins.max()) >= 64:
        raise ValueError("sub_scales and sub_mins are 6-bit values (0..63)")
    pairs = _pack_k_scales(
        _tile_sub_scales(sub_scales.to(torch.uint8), num_groups),
        _tile_sub_scales(sub_mins.to(torch.uint8), num_groups),
    )
    return PackedQuant(
        WeightKind.SUPER_AFFINE,
        bits,
        tile_codes(codes, bits),
        _tile_scales(d, torch.float16),
        _tile_scales(dmin, torch.float16),
        pairs,
        0,
        out_features,
        in_features,
        SUPER_BLOCK,
    )


def _pack_k_scales(scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """6-bit scales and mins `[tiles, groups, 8 blocks, 8 rows]` -> `[tiles, groups, 96]`: the low
    nibbles of blocks b and b + 4 share a byte (scales, then mins), then one byte per (b < 4, row)
    of the four values' top 2 bits (csrc/block_dots.h, k_block_scales)."""
    tiles, groups = scales.shape[:2]
    low = lambda t: ((t[:, :, :4] & 0x0F) | ((t[:, :, 4:] & 0x0F) << 4)).reshape(tiles, groups, 32)  # noqa: E731
    high = (
        (scales[:, :, :4] >> 4)
        | ((scales[:, :, 4:] >> 4) << 2)
        | ((mins[:, :, :4] >> 4) << 4)
        | ((mins[:, :, 4:] >> 4) << 6)
    ).reshape(tiles, groups, 32)
    return torch.cat([low(scales), low(mins), high], dim=-1).contiguous()


def _unpack_k_scales(pairs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of `_pack_k_scales`."""
    tiles, groups = pairs.shape[:2]
    low_scales, low_mins, high = (
        pairs[..., 32 * i : 32 * (i + 1)].reshape(tiles, groups, 4, 8) for i in range(3)
    )
    top = lambda shift: ((high >> shift) & 3) << 4  # noqa: E731
    scales = torch.cat([(low_scales & 0x0F) | top(0), (low_scales >> 4) | top(2)], dim=2)
    mins = torch.cat([(low_mins & 0x0F) | top(4), (low_mins >> 4) | top(6)], dim=2)
    return scales, mins


def pack_super_sym(
    codes: torch.Tensor, bits: int, d: torch.Tensor, sub_scales: torch.Tensor, zero_point: int
) -> PackedQuant:
    """Q6_K: w = d[o, s] * sc[o, h] * (q - zero_point), `d` float16 `[out, in // 256]`, `sub_scales`
    int8 `[out, in // 16]` per half-block h of 16 columns."""
    out_features, in_features = codes.shape
    _check_group_size(in_features, SUPER_BLOCK)
    num_groups = in_features // SUPER_BLOCK
    _check_shape("d", d, (out_features, num_groups))
    _check_shape("sub_scales", sub_scales, (out_features, in_features // (BLOCK // 2)))
    return PackedQuant(
        WeightKind.SUPER_SYM,
        bits,
        tile_codes(codes, bits),
        _tile_scales(d, torch.float16),
        None,
        _tile_sub_scales(sub_scales.to(torch.int8), num_groups),
        zero_point,
        out_features,
        in_features,
        SUPER_BLOCK,
    )


def pack_sym(
    codes: torch.Tensor, bits: int, scales: torch.Tensor, group_size: int, zero_point: int
) -> PackedQuant:
    """Unsigned `codes` uint8 `[out, in]` (4, 5 or 8 bits) with `scales` `[out, in // group_size]`:
    w[o, c] = scales[o, c // g] * (q[o, c] - zero_point). `group_size` is a multiple of 32 dividing
    `in`, or `in` itself (one scale per row; then any `in`: the last block is padded)."""
    if codes.dim() != 2 or bits not in (4, 5, 8) or not 0 <= zero_point < 2**bits:
        raise ValueError(
            f"symmetric codes must be 2-D with 4, 5 or 8 bits and a zero point below 2^bits, got "
            f"{list(codes.shape)}, {bits} bits, zero point {zero_point}"
        )
    out_features, in_features = codes.shape
    if group_size != in_features:
        _check_group_size(in_features, group_size)
    num_groups = in_features // group_size
    _check_shape("scales", scales, (out_features, num_groups))
    padded = F.pad(codes, (0, -in_features % BLOCK), value=zero_point)
    return PackedQuant(
        WeightKind.SYM,
        bits,
        tile_codes(padded, bits),
        _tile_scales(scales, _scale_dtype(scales)),
        None,
        None,
        zero_point,
        out_features,
        in_features,
        group_size,
    )


def pack_int8(qweight: torch.Tensor, scales: torch.Tensor, group_size: int) -> PackedQuant:
    """Signed `qweight` int8 [out, in] with `scales` [out, in // group_size], w = scales[o, c // g]
    * q, stored as q + 128 with zero point 128. `group_size` is `in` (per output channel; any `in`)
    or a multiple of 32 dividing `in`."""
    if qweight.dim() != 2 or qweight.dtype != torch.int8 or qweight.shape[1] == 0:
        raise ValueError(
            f"qweight must be int8 [out, in > 0], got {qweight.dtype} {list(qweight.shape)}"
        )
    codes = (qweight.to(torch.int16) + 128).to(torch.uint8)
    return pack_sym(codes, 8, scales, group_size, 128)


_TILED_FIELDS = ("codes", "scales", "offsets", "sub_scales")  # [tiles, ...] each


def pack_in_row_chunks(
    out_features: int, chunk_rows: int, pack_rows: Callable[[int, int], PackedQuant]
) -> PackedQuant:
    """The weight `pack_rows(0, out_features)` would give, packed `chunk_rows` output rows at a time
    (a multiple of 8) into tensors allocated once, in huge pages (weight_memory.py): decoding and
    tiling then hold one chunk's temporaries, not the whole weight's (a vocabulary-sized embedding's
    would be several times its packed size)."""
    if chunk_rows <= 0 or chunk_rows % TILE_ROWS:
        raise ValueError(f"chunk_rows must be a positive multiple of {TILE_ROWS}, got {chunk_rows}")
    first = pack_rows(0, min(out_features, chunk_rows))
    num_tiles = _num_tiles(out_features)
    whole: dict[str, torch.Tensor | None] = {}
    for name in _TILED_FIELDS:
        part = getattr(first, name)
        whole[name] = (
            None if part is None else ARENA.empty((num_tiles, *part.shape[1:]), part.dtype)
        )
    for start in range(0, out_features, chunk_rows):
        part = first if start == 0 else pack_rows(start, min(out_features, start + chunk_rows))
        tile = start // TILE_ROWS
        for name, target in whole.items():
            if target is not None:
                chunk = getattr(part, name)
                target[tile : tile + chunk.shape[0]] = chunk
    return replace(first, out_features=out_features, **whole)  # type: ignore[arg-type]


def _untile(t: torch.Tensor, out_features: int) -> torch.Tensor:
    """[tiles, groups, (subs,) 8] -> [out, groups * subs]."""
    rows_last = t.movedim(-1, 1)  # [tiles, 8, groups, (subs)]
    return rows_last.reshape(t.shape[0] * TILE_ROWS, -1)[:out_features]


def _dequantize_packed(p: PackedQuant) -> torch.Tensor:
    out, cols = p.out_features, p.in_features
    codes = untile_codes(p.codes, p.code_bits, out)[:, :cols].float()

    def per_column(t: torch.Tensor | None, width: int) -> torch.Tensor:
        assert t is not None, f"{p.kind} weights carry every part their formula uses"
        return _untile(t, out).float().repeat_interleave(width, dim=1)[:, :cols]

    if p.kind == WeightKind.SYM:
        return per_column(p.scales, p.group_size) * (codes - p.zero_point)
    if p.kind == WeightKind.AFFINE:
        return codes * per_column(p.scales, p.group_size) + per_column(p.offsets, p.group_size)
    d = per_column(p.scales, SUPER_BLOCK)
    if p.kind == WeightKind.SUPER_AFFINE:
        assert p.sub_scales is not None
        scales, mins = _unpack_k_scales(p.sub_scales)
        return (d * per_column(scales, BLOCK)) * codes - per_column(
            p.offsets, SUPER_BLOCK
        ) * per_column(mins, BLOCK)
    assert p.sub_scales is not None
    sc = _untile(p.sub_scales.view(torch.int8), out).float().repeat_interleave(BLOCK // 2, dim=1)
    return (d * sc) * (codes - p.zero_point)
