"""The CPU int4/int8 linear kernels against float64 references.

Two references per case. The kernel quantizes each activation row to int8 per block of 32
(d = max|x| / 127) and then computes exactly in integers, so against x rounded the same way
(taken from the kernel's own quantizer) only float32 round-off remains: |error| <= 1e-5 * sum|terms|
(at most ~50 scaled block sums of float32, each off by ~6e-8 relative). Against the unrounded x,
each activation may move by up to d/2, so |error| <= sum_c |w_c| * d(c) / 2 (plus the same
round-off), and overall the error must look like independent rounding noise, uniform on
[-d/2, d/2]: its norm within 3x of sqrt(sum_c w_c^2 * d(c)^2 / 12) per output. The offsets of int4
weights multiply the sums of the rounded activations too, so the noise is weighted by the weights
themselves, not by their unsigned codes.
"""

from __future__ import annotations

import pytest
import torch
from cpu_quant_helpers import (
    random_activations,
    random_int4,
    random_int8,
    reference,
    require_kernels,
)

from rebar.kernels import cpu_quant

# SmolLM2-135M's projections (out, in), plus odd sizes: a partial last tile of 8 output rows.
SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536), (13, 576), (21, 64)]
# 33 rows: the prefill schedule (quant_gemm.cpp, from 32 rows on) on rebar's worker pool; 67: on
# torch's threads (from 64), with an odd last row.
ROWS = [1, 3, 16, 33, 67]
ROUND_OFF = 1e-5


@pytest.fixture(scope="module", autouse=True)
def cpu_kernels() -> None:
    require_kernels()


def assert_matches(y: torch.Tensor, x: torch.Tensor, weight) -> None:
    ref = reference(x, weight)
    assert y.dtype == torch.float32 and y.shape == ref.exact.shape
    y = y.double()
    same_error = (y - ref.same_activations).abs()
    assert (same_error <= ROUND_OFF * ref.magnitude + 1e-30).all(), f"max {same_error.max():.3g}"
    exact_error = (y - ref.exact).abs()
    assert (exact_error <= ref.rounding_bound + ROUND_OFF * ref.magnitude).all()
    assert exact_error.norm() <= 3 * ref.rounding_rms.norm()


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("out_f,in_f", SHAPES)
@pytest.mark.parametrize(
    "group_size,dtype", [(32, torch.float16), (32, torch.float32), (64, torch.float16)]
)
def test_int4_linear(out_f: int, in_f: int, rows: int, group_size: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(out_f * 7 + in_f + rows)
    weight = random_int4(out_f, in_f, group_size, dtype, gen)
    x = random_activations(rows, in_f, gen)
    assert_matches(
        cpu_quant.int4_linear(x, weight.qweight, weight.scales, weight.offsets, group_size),
        x,
        weight,
    )


@pytest.mark.parametrize("rows", [1, 5, 16])
@pytest.mark.parametrize("group_size", [128, 192])
def test_int4_larger_groups(rows: int, group_size: int) -> None:
    gen = torch.Generator().manual_seed(rows + group_size)
    weight = random_int4(200, 1536, group_size, torch.float32, gen)
    x = random_activations(rows, 1536, gen)
    assert_matches(
        cpu_quant.int4_linear(x, weight.qweight, weight.scales, weight.offsets, group_size),
        x,
        weight,
    )


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("out_f,in_f", SHAPES)
@pytest.mark.parametrize("per_channel,dtype", [(True, torch.float32), (False, torch.float16)])
def test_int8_linear(
    out_f: int, in_f: int, rows: int, per_channel: bool, dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(out_f * 5 + in_f + rows)
    group_size = in_f if per_channel else 32
    weight = random_int8(out_f, in_f, group_size, dtype, gen)
    x = random_activations(rows, in_f, gen)
    assert_matches(cpu_quant.int8_linear(x, weight.qweight, weight.scales, group_size), x, weight)


@pytest.mark.parametrize("in_f", [100, 31, 1])
def test_int8_per_channel_ragged_width(in_f: int) -> None:
    """Per-channel scales allow any width: the last block is zero-padded."""
    gen = torch.Generator().manual_seed(in_f)
    weight = random_int8(19, in_f, in_f, torch.float32, gen)
    x = random_activations(3, in_f, gen)
    assert_matches(cpu_quant.int8_linear(x, weight.qweight, weight.scales, in_f), x, weight)


@pytest.mark.parametrize("rows", [1, 16])
def test_lm_head_shape(rows: int) -> None:
    """SmolLM2's lm_head, 576 -> 49152, in the GGUF Q4_1 form (group 32, float16 scale and offset)."""
    gen = torch.Generator().manual_seed(rows)
    weight = random_int4(49152, 576, 32, torch.float16, gen)
    x = random_activations(rows, 576, gen)
    packed = cpu_quant.pack_int4(weight.qweight, weight.scales, weight.offsets, 32)
    assert_matches(cpu_quant.linear_packed(x, packed), x, weight)


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_rows_are_batch_invariant(kind: str) -> None:
    """A row's output is bitwise the same alone or inside any batch (greedy decode must not depend
    on what else is batched), and the same for any thread count."""
    gen = torch.Generator().manual_seed(3)
    if kind == "int4":
        weight = random_int4(100, 576, 32, torch.float16, gen)
        packed = cpu_quant.pack_int4(weight.qweight, weight.scales, weight.offsets, 32)
        linear = cpu_quant.linear_packed
    else:
        weight = random_int8(100, 576, 576, torch.float32, gen)
        packed = cpu_quant.pack_int8(weight.qweight, weight.scales, 576)
        linear = cpu_quant.linear_packed
    x = random_activations(75, 576, gen)  # from 32 rows on, the prefill schedule
    batched = linear(x, packed)
    for i in range(len(x)):
        assert torch.equal(linear(x[i : i + 1], packed), batched[i : i + 1])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(linear(x, packed), batched)
    finally:
        torch.set_num_threads(threads)


def test_int4_prefill_panels_match_single_rows() -> None:
    """Past one L2-sized panel of activation rows (170 rows of width 1536), every row still gets the
    bits it gets alone."""
    gen = torch.Generator().manual_seed(4)
    weight = random_int4(40, 1536, 32, torch.float16, gen)
    packed = cpu_quant.pack_int4(weight.qweight, weight.scales, weight.offsets, 32)
    x = random_activations(345, 1536, gen)
    batched = cpu_quant.linear_packed(x, packed)
    assert_matches(batched, x, weight)
    for i in (0, 169, 170, 171, 339, 340, 344):
        assert torch.equal(cpu_quant.linear_packed(x[i : i + 1], packed), batched[i : i + 1])


def test_leading_dims_and_empty_batch() -> None:
    gen = torch.Generator().manual_seed(4)
    weight = random_int4(24, 64, 32, torch.float16, gen)
    packed = cpu_quant.pack_int4(weight.qweight, weight.scales, weight.offsets, 32)
    x = random_activations(6, 64, gen)
    y = cpu_quant.linear_packed(x.reshape(2, 3, 64), packed)
    assert y.shape == (2, 3, 24) and torch.equal(
        y.reshape(6, 24), cpu_quant.linear_packed(x, packed)
    )
    assert cpu_quant.linear_packed(torch.empty(0, 64), packed).shape == (0, 24)
    strided = torch.randn(64, 6, generator=gen).T  # non-contiguous input is accepted
    assert torch.equal(
        cpu_quant.linear_packed(strided, packed),
        cpu_quant.linear_packed(strided.contiguous(), packed),
    )


def test_activation_quantizer() -> None:
    """q = round(x * 127 / max|x|) per block of 32 (ties to even), zero padding, exact block sums;
    with half scales, the same codes, and d and each block's sum d * sum(q) rounded to float16 as
    llama.cpp's Q8_0 / Q8_1 blocks store them."""
    gen = torch.Generator().manual_seed(5)
    x = random_activations(4, 100, gen)
    x[1] = 0.0  # an all-zero row: scale 0, codes 0
    q, d, sums, half_sums = cpu_quant.quantize_activations(x, group_size=32)
    padded = torch.nn.functional.pad(x, (0, 28)).reshape(4, 4, 32)
    amax = padded.abs().amax(dim=-1)
    assert torch.equal(d, amax / 127)
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    expected = torch.round(padded * inv[..., None]).to(torch.int8).reshape(4, 128)
    assert torch.equal(q, expected)
    assert torch.equal(half_sums, q.reshape(4, 8, 16).int().sum(dim=-1))
    # the offsets multiply the sums of the rounded activations, d * sum(q)
    block_sums = half_sums.reshape(4, 4, 2).sum(dim=-1).float()
    torch.testing.assert_close(sums, d * block_sums, rtol=1e-6, atol=0)
    assert q.abs().max() <= 127

    half_q, half_d, half_group_sums, same_half_sums = cpu_quant.quantize_activations(
        x, group_size=64, half_scales=True
    )
    assert torch.equal(half_q, q) and torch.equal(same_half_sums, half_sums)
    assert torch.equal(half_d, d.half().float()) and not torch.equal(half_d, d)
    per_block = (d * block_sums).half().float().reshape(4, 2, 2).sum(dim=-1)
    torch.testing.assert_close(half_group_sums, per_block, rtol=1e-6, atol=0)


def test_bad_inputs_raise_value_errors() -> None:
    gen = torch.Generator().manual_seed(6)
    weight = random_int4(16, 64, 32, torch.float16, gen)
    packed = cpu_quant.pack_int4(weight.qweight, weight.scales, weight.offsets, 32)
    with pytest.raises(ValueError, match="float32"):
        cpu_quant.linear_packed(torch.randn(2, 64, dtype=torch.float64), packed)
    with pytest.raises(ValueError, match=r"\[\.\.\., 64\]"):
        cpu_quant.linear_packed(torch.randn(2, 65), packed)


def test_concurrent_prefill_calls_match_sequential_ones() -> None:
    """Two Python threads running prefill-sized calls at once (each on torch's thread pool, each
    with its own thread-local activation scratch) get exactly what they get one after the other."""
    from concurrent.futures import ThreadPoolExecutor

    gen = torch.Generator().manual_seed(6)
    weight = random_int4(96, 576, 32, torch.float16, gen)
    packed = cpu_quant.pack_int4(weight.qweight, weight.scales, weight.offsets, 32)
    inputs = [random_activations(200 + 17 * i, 576, gen) for i in range(6)]
    expected = [cpu_quant.linear_packed(x, packed) for x in inputs]
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda x: cpu_quant.linear_packed(x, packed), inputs))
    assert all(torch.equal(got, want) for got, want in zip(results, expected))
