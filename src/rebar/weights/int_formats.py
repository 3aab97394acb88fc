"""Integer weight formats: quantize, pack, unpack and dequantize, in plain torch.

Two formats cover every quantized weight rebar runs:

- int8, symmetric: `w = scale * q`, q in [-127, 127], one scale per output channel or per group of
  `group_size` consecutive input channels.
- int4, asymmetric: `w = scale * q + offset`, q in [0, 15], one (scale, offset) per group. The
  offset is a float (the value code 0 decodes to), so GGUF Q4_1 (`w = d*q + m`) maps onto it exactly
  and Q4_0 (`w = d*(q - 8)`) as offset = -8d. Two codes share a byte: column 2j in the low nibble,
  column 2j+1 in the high one.

These canonical layouts are what checkpoints store; kernels repack them as they need (qlinear.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

INT8_MAX = 127
INT4_MAX = 15
SCALE_DTYPE = torch.float16  # what checkpoints store; GGUF uses fp16 block scales as well


@dataclass(frozen=True)
class QuantizedWeight:
    """A linear (or embedding) weight `[out_features, in_features]` held as integer codes.

    `group_size` counts input channels per scale; it equals `in_features` for one scale per output
    channel. Tensors may be views of a memory-mapped file; nothing here writes to them.
    """

    bits: int  # 8 or 4
    group_size: int
    qweight: torch.Tensor  # int8 [out, in] (bits 8) or uint8 [out, in // 2] (bits 4)
    scales: torch.Tensor  # [out, in // group_size] float
    offsets: torch.Tensor | None = None  # [out, in // group_size] float; bits 4 only

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    @property
    def in_features(self) -> int:
        return self.qweight.shape[1] * (2 if self.bits == 4 else 1)

    @property
    def device(self) -> torch.device:
        return self.qweight.device

    @property
    def num_groups(self) -> int:
        return self.scales.shape[1]

    @property
    def num_bytes(self) -> int:
        parts = [self.qweight, self.scales] + ([self.offsets] if self.offsets is not None else [])
        return sum(t.numel() * t.element_size() for t in parts)

    def describe(self) -> str:
        """E.g. "int4 g64" or "int8 per-channel" (for `rebar inspect` and logs)."""
        groups = "per-channel" if self.group_size == self.in_features else f"g{self.group_size}"
        return f"int{self.bits} {groups}"

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight `[out, in]` in `dtype` (computed in float32, then cast)."""
        return self.dequantize_rows(None, dtype)

    def dequantize_rows(
        self, rows: torch.Tensor | None, dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """Rows `rows` (int64 indices; None for all) of the float weight, e.g. an embedding
        lookup."""
        pick = (lambda t: t) if rows is None else (lambda t: t.index_select(0, rows))
        codes = pick(self.qweight)
        num_rows = codes.shape[0]
        codes = codes if self.bits == 8 else unpack_int4(codes)
        # [rows, groups, group_size], scaled in place: scales and offsets broadcast, no temporaries.
        values = codes.float().view(num_rows, self.num_groups, self.group_size)
        values.mul_(pick(self.scales).float().unsqueeze(-1))
        if self.offsets is not None:
            values.add_(pick(self.offsets).float().unsqueeze(-1))
        return values.view(num_rows, self.in_features).to(dtype)

    def row_slice(self, start: int, end: int) -> QuantizedWeight:
        """Output channels [start, end) as views (no copy)."""
        offsets = None if self.offsets is None else self.offsets[start:end]
        return QuantizedWeight(
            self.bits, self.group_size, self.qweight[start:end], self.scales[start:end], offsets
        )

    def to(self, device: torch.device) -> QuantizedWeight:
        offsets = None if self.offsets is None else self.offsets.to(device)
        return QuantizedWeight(
            self.bits, self.group_size, self.qweight.to(device), self.scales.to(device), offsets
        )

    def select_rows(self, rows: torch.Tensor) -> QuantizedWeight:
        """The same weight with output channels reordered (rows are independent in both formats)."""
        offsets = None if self.offsets is None else self.offsets.index_select(0, rows)
        return QuantizedWeight(
            self.bits,
            self.group_size,
            self.qweight.index_select(0, rows),
            self.scales.index_select(0, rows),
            offsets,
        )


def check_group_size(in_features: int, group_size: int, bits: int, name: str) -> None:
    """Raise ValueError unless `group_size` tiles `in_features` (and int4 codes pair up)."""
    if group_size <= 0 or in_features % group_size != 0:
        raise ValueError(
            f"group size {group_size} does not divide {name}'s {in_features} input channels"
        )
    if bits == 4 and group_size % 2 != 0:
        raise ValueError(f"int4 needs an even group size, got {group_size}")


def _grouped(weight: torch.Tensor, group_size: int) -> torch.Tensor:
    # [out, in] -> [out, num_groups, group_size], in float32
    out_features, in_features = weight.shape
    return weight.float().reshape(out_features, in_features // group_size, group_size)


def quantize_int8(weight: torch.Tensor, group_size: int | None = None) -> QuantizedWeight:
    """Symmetric int8 with a scale per output channel (group_size None) or per group."""
    group_size = group_size or weight.shape[1]
    check_group_size(weight.shape[1], group_size, 8, "the weight")
    groups = _grouped(weight, group_size)
    amax = groups.abs().amax(dim=-1)  # [out, num_groups]
    # Round the scale to its stored dtype first so codes are chosen against the scale that is kept.
    scales = (amax / INT8_MAX).to(SCALE_DTYPE)
    divisor = torch.where(scales.float() > 0, scales.float(), 1.0).unsqueeze(-1)
    codes = torch.round(groups / divisor).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return QuantizedWeight(8, group_size, codes.reshape(weight.shape), scales)


def int4_scales_offsets(
    groups: torch.Tensor, clip_ratio: torch.Tensor | float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(scales, offsets) `[out, num_groups]` mapping each group's (clipped) [min, max] onto codes
    0..15.

    `clip_ratio` (scalar or `[out, num_groups]`) shrinks the range towards zero: min*r, max*r.
    """
    ratio = clip_ratio.unsqueeze(-1) if isinstance(clip_ratio, torch.Tensor) else clip_ratio
    low = (groups.amin(dim=-1, keepdim=True) * ratio).squeeze(-1)
    high = (groups.amax(dim=-1, keepdim=True) * ratio).squeeze(-1)
    return int4_range_grid(low, high)


def int4_range_grid(low: torch.Tensor, high: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(scales, offsets), stored dtype, of the grid whose codes 0..15 span [low, high]."""
    return ((high - low) / INT4_MAX).to(SCALE_DTYPE), low.to(SCALE_DTYPE)


def _nearest_codes(
    groups: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor
) -> torch.Tensor:
    """Nearest codes 0..15 in `groups`' float dtype; scales/offsets `[...]` cover `groups` `[...,
    g]`."""
    scale = scales.to(groups.dtype).unsqueeze(-1)
    divisor = torch.where(scale > 0, scale, 1.0)  # a constant group: every weight is its offset
    return (
        ((groups - offsets.to(groups.dtype).unsqueeze(-1)) / divisor).round_().clamp_(0, INT4_MAX)
    )


def int4_codes(groups: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Nearest codes 0..15 (uint8, same shape as `groups`) for the stored scales and offsets."""
    return _nearest_codes(groups, scales, offsets).to(torch.uint8)


def onto_int4_grid(
    groups: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor
) -> torch.Tensor:
    """Each value of `groups` `[..., g]` moved to its nearest point of its grid `scales * q +
    offsets` (`[...]`, q in 0..15), in `groups`' dtype: the dequantized value of the code it would
    get."""
    codes = _nearest_codes(groups, scales, offsets)
    return codes.mul_(scales.to(groups.dtype).unsqueeze(-1)).add_(
        offsets.to(groups.dtype).unsqueeze(-1)
    )


def quantize_int4(
    weight: torch.Tensor, group_size: int, clip_ratio: torch.Tensor | float = 1.0
) -> QuantizedWeight:
    """Grouped asymmetric int4 (round to nearest), optionally with a clipped range per group."""
    check_group_size(weight.shape[1], group_size, 4, "the weight")
    scales, offsets = int4_scales_offsets(_grouped(weight, group_size), clip_ratio)
    return quantize_int4_on_grid(weight, group_size, scales, offsets)


def quantize_int4_on_grid(
    weight: torch.Tensor, group_size: int, scales: torch.Tensor, offsets: torch.Tensor
) -> QuantizedWeight:
    """Grouped int4 with given (scales, offsets) `[out, num_groups]`: each weight gets its nearest
    code."""
    check_group_size(weight.shape[1], group_size, 4, "the weight")
    scales, offsets = scales.to(SCALE_DTYPE), offsets.to(SCALE_DTYPE)
    codes = int4_codes(_grouped(weight, group_size), scales, offsets).reshape(weight.shape)
    return QuantizedWeight(4, group_size, pack_int4(codes), scales, offsets)


def fake_quantize_int4(
    weight: torch.Tensor, group_size: int, clip_ratio: torch.Tensor | float = 1.0
) -> torch.Tensor:
    """What `quantize_int4(...).dequantize()` returns, without packing (used by searches)."""
    groups = _grouped(weight, group_size)
    return onto_int4_grid(groups, *int4_scales_offsets(groups, clip_ratio)).reshape(weight.shape)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes 0..15 `[rows, cols]` (cols even) -> `[rows, cols // 2]`, low nibble first."""
    codes = codes.to(torch.uint8)
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_int4`: `[rows, n]` uint8 -> `[rows, 2n]` codes 0..15 (uint8)."""
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(packed.shape[0], -1)
