"""Integer formats: packing, quantization error bounds, exact grids, row access."""

from __future__ import annotations

import pytest
import torch

from rebar.weights.int_formats import (
    INT4_MAX,
    SCALE_DTYPE,
    QuantizedWeight,
    check_group_size,
    fake_quantize_int4,
    pack_int4,
    quantize_int4,
    quantize_int8,
    unpack_int4,
)


def weight(out_features: int = 48, in_features: int = 128, seed: int = 0) -> torch.Tensor:
    return (
        torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed)) * 0.05
    )


def per_element(values: torch.Tensor, group_size: int) -> torch.Tensor:
    return values.float().repeat_interleave(group_size, dim=1)


def test_pack_unpack_round_trip_and_nibble_order() -> None:
    codes = torch.randint(
        0, 16, (5, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(1)
    )
    packed = pack_int4(codes)
    assert packed.shape == (5, 32) and packed.dtype == torch.uint8
    assert torch.equal(unpack_int4(packed), codes)
    # column 2j sits in the low nibble, 2j+1 in the high one
    assert int(packed[0, 0]) == int(codes[0, 0]) | (int(codes[0, 1]) << 4)


@pytest.mark.parametrize("group_size", [None, 32])
def test_int8_error_is_at_most_half_a_step(group_size: int | None) -> None:
    w = weight()
    q = quantize_int8(w, group_size)
    assert q.bits == 8 and q.qweight.dtype == torch.int8 and q.scales.dtype == SCALE_DTYPE
    assert q.group_size == (group_size or w.shape[1])
    assert q.qweight.abs().max() <= 127
    step = per_element(q.scales, q.group_size)
    assert ((q.dequantize() - w).abs() <= step / 2 + 1e-7).all()
    # the largest weight of each group lands on (or next to) the end of the code range
    assert q.qweight.abs().amax(dim=1).min() >= 126


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_error_is_at_most_half_a_step(group_size: int) -> None:
    w = weight()
    q = quantize_int4(w, group_size)
    assert q.qweight.shape == (48, 64) and q.scales.shape == q.offsets.shape == (
        48,
        128 // group_size,
    )
    codes = unpack_int4(q.qweight)
    assert codes.max() <= INT4_MAX
    step = per_element(q.scales, group_size)
    # fp16 offsets may shift the grid by a fraction of a step; allow that rounding on top of half a
    # step
    slack = per_element(q.offsets.float().abs(), group_size) * 2**-10
    assert ((q.dequantize() - w).abs() <= step / 2 + slack + 1e-7).all()


def test_int4_is_exact_on_weights_already_on_its_grid() -> None:
    """A group of values d*q + m (fp16 d and m, codes spanning 0..15) comes back unchanged, as from
    GGUF Q4_1."""
    generator = torch.Generator().manual_seed(2)
    codes = torch.randint(0, 16, (16, 64), generator=generator)
    codes[:, ::32] = 0
    codes[:, 1::32] = 15
    d = (torch.rand(16, 2, generator=generator) * 0.01 + 0.001).to(torch.float16)
    m = (torch.randn(16, 2, generator=generator) * 0.05).to(torch.float16)
    w = codes.float() * per_element(d, 32) + per_element(m, 32)
    q = quantize_int4(w, 32)
    assert torch.equal(q.scales, d) and torch.equal(q.offsets, m)
    assert torch.equal(unpack_int4(q.qweight).long(), codes)
    assert torch.equal(q.dequantize(), w)


def test_constant_group_is_exact() -> None:
    w = torch.full((16, 32), 0.25)
    assert torch.equal(quantize_int4(w, 32).dequantize(), w)
    assert torch.equal(quantize_int8(torch.zeros(4, 8)).dequantize(), torch.zeros(4, 8))


def test_clip_ratio_shrinks_the_range() -> None:
    w = weight()
    full, clipped = quantize_int4(w, 32), quantize_int4(w, 32, clip_ratio=0.5)
    assert torch.allclose(clipped.scales.float(), full.scales.float() * 0.5, rtol=2e-3)
    per_group = torch.full((48, 4), 0.5)
    assert torch.equal(quantize_int4(w, 32, clip_ratio=per_group).scales, clipped.scales)


@pytest.mark.parametrize("clip", [1.0, 0.8])
def test_fake_quantize_equals_quantize_then_dequantize(clip: float) -> None:
    w = weight()
    assert torch.equal(fake_quantize_int4(w, 64, clip), quantize_int4(w, 64, clip).dequantize())


@pytest.mark.parametrize(
    "make",
    [lambda w: quantize_int8(w), lambda w: quantize_int8(w, 32), lambda w: quantize_int4(w, 32)],
)
def test_rows_and_dtypes(make) -> None:
    q: QuantizedWeight = make(weight())
    rows = torch.tensor([5, 0, 47, 5])
    assert torch.equal(q.dequantize_rows(rows), q.dequantize()[rows])
    assert q.dequantize(torch.bfloat16).dtype == torch.bfloat16
    assert torch.equal(q.select_rows(rows).dequantize(), q.dequantize()[rows])
    assert (q.out_features, q.in_features) == (48, 128)


def test_describe_and_size() -> None:
    w = weight()
    assert quantize_int8(w).describe() == "int8 per-channel"
    q4 = quantize_int4(w, 64)
    assert q4.describe() == "int4 g64"
    assert q4.num_bytes == 48 * 64 + 2 * 48 * 2 * 2


def test_group_size_must_tile_the_input() -> None:
    with pytest.raises(
        ValueError, match=r"group size 128 does not divide layer\.x's 576 input channels"
    ):
        check_group_size(576, 128, 4, "layer.x")
    with pytest.raises(ValueError, match="even"):
        check_group_size(63, 21, 4, "w")
    with pytest.raises(ValueError, match="does not divide"):
        quantize_int4(weight(), 48)
