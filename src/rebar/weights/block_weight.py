"""GGUF weights kept in their own block formats: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K.

A `BlockWeight` holds a 2-D tensor's bytes exactly as the file stores them (rows are independent: a
row is a whole number of blocks), usually as a view of the memory-mapped file, and decodes them on
demand into codes and scales (`DecodedBlocks`): the layout rebar's kernels are packed from, and the
float values llama.cpp's own dequantization gives.

Block layouts (ggml-common.h; fp16 little-endian; 32 values per block, 256 per K-quant super-block):

- Q4_0  (18 bytes): d, qs[16] (value j: low nibble of qs[j], j+16: high nibble); w = d * (q - 8)
- Q4_1  (20 bytes): d, m, qs[16]; w = d * q + m
- Q8_0  (34 bytes): d, int8 qs[32]; w = d * q
- Q5_0  (22 bytes): d, qh (32 high bits), qs[16] (nibbles as Q4_0); w = d * (q - 16)
- Q5_1  (24 bytes): d, m, qh, qs[16]; w = d * q + m
- Q4_K (144 bytes): d, dmin, 12 bytes of 6-bit (sc, m) pairs for the 8 sub-blocks, qs[128] (64
  values per 32 bytes: low nibbles first); w = d * sc * q - dmin * m
- Q5_K (176 bytes): as Q4_K, plus qh[32] before qs (bit s of qh[l]: value l of sub-block s)
- Q6_K (210 bytes): ql[128], qh[64], int8 scales[16] (one per 16 values), d;
  w = d * scale * (q - 32)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

BLOCK = 32
SUPER_BLOCK = 256

# type name -> (bytes per block, values per block)
BLOCK_LAYOUTS = {
    "Q4_0": (18, BLOCK),
    "Q4_1": (20, BLOCK),
    "Q5_0": (22, BLOCK),
    "Q5_1": (24, BLOCK),
    "Q8_0": (34, BLOCK),
    "Q4_K": (144, SUPER_BLOCK),
    "Q5_K": (176, SUPER_BLOCK),
    "Q6_K": (210, SUPER_BLOCK),
}
Q6_K_ZERO_POINT = 32


@dataclass(frozen=True)
class DecodedBlocks:
    """A block-format weight as unsigned codes and scales (kinds as in rebar.kernels.cpu_quant).

    - "sym" (Q4_0, Q5_0, Q8_0): w = scales * (q - zero_point), scales float16 `[rows, in // 32]`;
      Q8_0's signed codes are stored plus 128, with zero point 128
    - "affine" (Q4_1, Q5_1): w = scales * q + offsets, per block of 32 (float16 `[rows, in // 32]`)
    - "super_affine" (Q4_K, Q5_K): w = d * sub_scales * q - dmin * sub_mins; d = scales, dmin =
      offsets float16 `[rows, in // 256]`, sub_scales / sub_mins uint8 `[rows, in // 32]`
    - "super_sym" (Q6_K): w = d * sub_scales * (q - zero_point); sub_scales int8 `[rows, in // 16]`
    """

    kind: str
    bits: int
    codes: torch.Tensor  # uint8 [rows, in]
    scales: torch.Tensor
    offsets: torch.Tensor | None = None
    sub_scales: torch.Tensor | None = None
    sub_mins: torch.Tensor | None = None
    zero_point: int = 0

    def dequantize(self) -> torch.Tensor:
        """float32 `[rows, in]`, computed as llama.cpp does (scale products in float32)."""
        q = self.codes.float()

        def per_column(t: torch.Tensor | None) -> torch.Tensor:
            assert t is not None, f"{self.kind} blocks carry every part their formula uses"
            return t.float().repeat_interleave(q.shape[1] // t.shape[1], dim=1)

        if self.kind == "sym":
            return per_column(self.scales) * (q - self.zero_point)
        if self.kind == "affine":
            return per_column(self.scales) * q + per_column(self.offsets)
        d, sc = per_column(self.scales), per_column(self.sub_scales)
        if self.kind == "super_affine":
            return (d * sc) * q - per_column(self.offsets) * per_column(self.sub_mins)
        return (d * sc) * (q - self.zero_point)


def _fp16(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """[n, bytes] -> [n] float16 from the two bytes at `offset`."""
    return blocks[:, offset : offset + 2].contiguous().view(torch.float16).squeeze(1)


def _bits_of(words: torch.Tensor) -> torch.Tensor:
    """[n, 4] bytes of a little-endian uint32 -> [n, 32] its bits, bit j at column j."""
    shifts = torch.arange(8, dtype=torch.uint8)
    return ((words.unsqueeze(-1) >> shifts) & 1).reshape(words.shape[0], 32)


def _legacy_codes(blocks: torch.Tensor, bits: int, start: int) -> torch.Tensor:
    """The 32 codes [n, 32] of Q4_0 / Q4_1 / Q5_0 / Q5_1 blocks whose code bytes (qh, qs) start at
    `start`."""
    if bits == 5:
        high = _bits_of(blocks[:, start : start + 4])
        start += 4
    qs = blocks[:, start : start + 16]
    codes = torch.cat([qs & 0x0F, qs >> 4], dim=1)
    return codes | (high << 4) if bits == 5 else codes


def _k_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, 12] bytes -> (sc, m) [n, 8] uint8: the 6-bit pairs of Q4_K / Q5_K (get_scale_min_k4)."""
    low, high = packed[:, 0:4], packed[:, 4:8]
    tail = packed[:, 8:12]
    sc = torch.cat([low & 63, (tail & 0x0F) | ((low >> 6) << 4)], dim=1)
    m = torch.cat([high & 63, (tail >> 4) | ((high >> 6) << 4)], dim=1)
    return sc, m


def _k_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[n, 128] -> [n, 256]: each 32 bytes hold 64 values, low nibbles first."""
    chunks = qs.reshape(-1, 4, 1, 32)
    return torch.cat([chunks & 0x0F, chunks >> 4], dim=2).reshape(-1, SUPER_BLOCK)


def _decode_q4_k(blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
    sc, m = _k_scales(blocks[:, 4:16])
    return _k_nibbles(blocks[:, 16:144]), _fp16(blocks, 0), _fp16(blocks, 2), sc, m


def _decode_q5_k(blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
    sc, m = _k_scales(blocks[:, 4:16])
    qh = blocks[:, 16:48]  # bit s of byte l: value l of sub-block s
    shifts = torch.arange(8, dtype=torch.uint8).view(1, 8, 1)
    high = ((qh.unsqueeze(1) >> shifts) & 1).reshape(-1, SUPER_BLOCK)
    return _k_nibbles(blocks[:, 48:176]) | (high << 4), _fp16(blocks, 0), _fp16(blocks, 2), sc, m


def _decode_q6_k(blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
    ql = blocks[:, 0:128].reshape(-1, 2, 2, 32)  # [n, half, (l | l + 32), 32]
    qh = blocks[:, 128:192].reshape(-1, 2, 1, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1)
    high = (qh >> shifts) & 3  # [n, half, 4, 32]: values l, l + 32, l + 64, l + 96 of the half
    low = torch.cat([ql & 0x0F, ql >> 4], dim=2)  # the same order
    codes = (low | (high << 4)).reshape(-1, SUPER_BLOCK)
    scales = blocks[:, 192:208].contiguous().view(torch.int8)
    return codes, _fp16(blocks, 208), scales


def decode_blocks(type_name: str, raw: torch.Tensor) -> DecodedBlocks:
    """`raw` uint8 `[rows, row_bytes]` of type `type_name` -> its codes and scales."""
    block_bytes, _per_block = BLOCK_LAYOUTS[type_name]
    rows = raw.shape[0]
    blocks = raw.reshape(-1, block_bytes)

    def per_row(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(rows, -1)

    d = _fp16(blocks, 0)
    if type_name == "Q8_0":
        codes = (blocks[:, 2:34].contiguous().view(torch.int8).to(torch.int16) + 128).to(
            torch.uint8
        )
        return DecodedBlocks("sym", 8, per_row(codes), per_row(d), zero_point=128)
    if type_name in ("Q4_0", "Q5_0"):  # w = d (q - 2^(bits - 1))
        bits = int(type_name[1])
        return DecodedBlocks(
            "sym",
            bits,
            per_row(_legacy_codes(blocks, bits, 2)),
            per_row(d),
            zero_point=1 << (bits - 1),
        )
    if type_name in ("Q4_1", "Q5_1"):
        bits = int(type_name[1])
        codes = _legacy_codes(blocks, bits, 4)
        return DecodedBlocks("affine", bits, per_row(codes), per_row(d), per_row(_fp16(blocks, 2)))
    if type_name == "Q6_K":
        codes, d, scales = _decode_q6_k(blocks)
        return DecodedBlocks(
            "super_sym",
            6,
            per_row(codes),
            per_row(d),
            sub_scales=per_row(scales),
            zero_point=Q6_K_ZERO_POINT,
        )
    codes, d, dmin, sc, m = (_decode_q4_k if type_name == "Q4_K" else _decode_q5_k)(blocks)
    bits = 4 if type_name == "Q4_K" else 5
    return DecodedBlocks(
        "super_affine", bits, per_row(codes), per_row(d), per_row(dmin), per_row(sc), per_row(m)
    )


@dataclass(frozen=True)
class BlockWeight:
    """A linear (or embedding) weight `[out_features, in_features]` in a GGML block format.

    `raw` is uint8 `[rows, row_bytes]`, the file's bytes for the tensor (usually a view of the
    memory-mapped file); nothing here writes to it. Row `o` of the weight is row `row_order[o]` of
    `raw` (all of them in order when `row_order` is None), so reordering rows, as the GGUF loader
    does for llama.cpp's permuted Q/K projections, costs no copy of the bytes. When `raw` views a
    file mapping, `release_pages` drops a view of it from resident memory (see `drop_resident`).
    """

    type_name: str
    raw: torch.Tensor
    in_features: int
    row_order: torch.Tensor | None = None  # int64 [out_features]
    release_pages: Callable[[torch.Tensor], None] | None = field(
        default=None, compare=False, repr=False
    )

    def __post_init__(self) -> None:
        if self.type_name not in BLOCK_LAYOUTS:
            raise ValueError(
                f"{self.type_name} is not a block format rebar keeps ({sorted(BLOCK_LAYOUTS)})"
            )
        block_bytes, per_block = BLOCK_LAYOUTS[self.type_name]
        if (
            self.in_features % per_block
            or self.raw.shape[-1] != self.in_features // per_block * block_bytes
        ):
            raise ValueError(
                f"{self.type_name} rows of {self.in_features} values take "
                f"{self.in_features // per_block * block_bytes} bytes, got {self.raw.shape[-1]}"
            )

    @property
    def out_features(self) -> int:
        return self.raw.shape[0] if self.row_order is None else self.row_order.shape[0]

    @property
    def device(self) -> torch.device:
        return self.raw.device

    @property
    def num_bytes(self) -> int:
        return self.out_features * self.raw.shape[1]

    def describe(self) -> str:
        return self.type_name

    def _rows(self, rows: torch.Tensor | None) -> torch.Tensor:
        """The raw bytes of weight rows `rows` (None: all), in order."""
        if rows is not None and self.row_order is not None:
            rows = self.row_order.index_select(0, rows.to(self.row_order.device))
        elif rows is None:
            rows = self.row_order
        return self.raw if rows is None else self.raw.index_select(0, rows.to(self.raw.device))

    def decode(self) -> DecodedBlocks:
        return decode_blocks(self.type_name, self._rows(None).cpu())

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.dequantize_rows(None, dtype)

    def dequantize_rows(
        self, rows: torch.Tensor | None, dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """Rows `rows` (int64 indices; None for all) of the float weight, e.g. an embedding
        lookup."""
        decoded = decode_blocks(self.type_name, self._rows(rows).cpu())
        return decoded.dequantize().to(device=self.raw.device, dtype=dtype)

    def select_rows(self, rows: torch.Tensor) -> BlockWeight:
        """The same weight with output rows reordered: row o becomes row rows[o] (no copy of the
        bytes)."""
        order = rows if self.row_order is None else self.row_order.index_select(0, rows)
        return BlockWeight(self.type_name, self.raw, self.in_features, order, self.release_pages)

    def row_slice(self, start: int, end: int) -> BlockWeight:
        if self.row_order is None:
            return BlockWeight(
                self.type_name, self.raw[start:end], self.in_features, None, self.release_pages
            )
        return BlockWeight(
            self.type_name,
            self.raw,
            self.in_features,
            self.row_order[start:end],
            self.release_pages,
        )

    def drop_resident(self) -> None:
        """Let this weight's file pages leave resident memory once its bytes are copied elsewhere (a
        later read maps them in again). Only rows in file order are released: a reordered weight's
        rows are scattered, and its owner releases the whole tensor instead."""
        if self.release_pages is not None and self.row_order is None:
            self.release_pages(self.raw)

    def to(self, device: torch.device) -> BlockWeight:
        if device == self.raw.device:
            return self
        order = None if self.row_order is None else self.row_order.to(device)
        return BlockWeight(self.type_name, self.raw.to(device), self.in_features, order)
