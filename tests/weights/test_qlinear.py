"""QuantLinear / QuantEmbedding and the kernel choice, against the dequantized reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from needs import need_cpu_kernels, requires
from rebar.kernels import cpu_quant
from rebar.weights import qlinear
from rebar.weights.int_formats import QuantizedWeight, quantize_int4, quantize_int8, unpack_int4
from rebar.weights.qlinear import (
    INT4_PACKED_MAX_ROWS,
    INT8_PACKED_MAX_ROWS,
    DequantizedMatmul,
    Int4PackedMatmul,
    Int8PackedMatmul,
    KernelChoice,
    QuantEmbedding,
    QuantLinear,
    has_packed_kernel,
    plan_kernels,
)

CPU = torch.device("cpu")
GENERATOR = torch.Generator().manual_seed(0)
WEIGHT = torch.randn(96, 256, generator=GENERATOR) * 0.05
X = torch.randn(40, 256, generator=GENERATOR)

WEIGHTS = {
    "int8": quantize_int8(WEIGHT),
    "int4-g32": quantize_int4(WEIGHT, 32),
    "int4-g64": quantize_int4(WEIGHT, 64),
    "int4-g128": quantize_int4(WEIGHT, 128),
}


def bf16_emulation(weight: QuantizedWeight, x: torch.Tensor) -> torch.Tensor:
    """What a bf16 packed kernel should compute: bf16 inputs, scales and zeros, float32 sums, a bf16
    result."""

    def per_element(values: torch.Tensor) -> torch.Tensor:
        return values.to(torch.bfloat16).float().repeat_interleave(weight.group_size, 1)

    if weight.bits == 8:
        w = weight.qweight.float() * per_element(weight.scales)
    else:
        zeros = (
            weight.offsets.float() + 8 * weight.scales.float()
        )  # the kernel decodes (q - 8) * scale + zero
        w = (unpack_int4(weight.qweight).float() - 8) * per_element(weight.scales) + per_element(
            zeros
        )
    return (x.to(torch.bfloat16).float() @ w.T).to(torch.bfloat16).float()


@pytest.mark.parametrize("name", list(WEIGHTS))
def test_dequantized_matmul_is_the_reference(name: str) -> None:
    weight = WEIGHTS[name]
    torch.testing.assert_close(
        DequantizedMatmul(weight)(X), X @ weight.dequantize().T, rtol=0, atol=1e-5
    )


@pytest.mark.parametrize("name", list(WEIGHTS))
def test_packed_kernels_match_the_reference(name: str) -> None:
    weight = WEIGHTS[name]
    kernel = Int8PackedMatmul(weight) if weight.bits == 8 else Int4PackedMatmul(weight)
    got = kernel(X)
    assert got.dtype == torch.float32 and got.shape == (40, 96)
    # Exactly what bf16 inputs and scales give, up to a bf16 rounding of the result...
    expected = bf16_emulation(weight, X)
    torch.testing.assert_close(got, expected, rtol=2**-7, atol=1e-3)
    # ...and close to the float32 reference.
    reference = X @ weight.dequantize().T
    assert (got - reference).abs().max() < 0.02 * reference.abs().max()


@pytest.mark.parametrize("name", list(WEIGHTS))
def test_packed_kernels_give_a_row_the_same_bits_at_any_batch_size(name: str) -> None:
    weight = WEIGHTS[name]
    kernel = Int8PackedMatmul(weight) if weight.bits == 8 else Int4PackedMatmul(weight)
    alone = kernel(X[:1])
    for rows in (2, 3, 8, 17, 32):
        assert torch.equal(kernel(X[:rows])[:1], alone)


@pytest.fixture()
def torch_packed_only(monkeypatch):
    """Plans as on a CPU where rebar's AVX2 kernels do not run."""
    monkeypatch.setattr(qlinear, "has_native_kernel", lambda weight, device: False)


def test_plan_uses_the_packed_kernel_for_small_batches_only(torch_packed_only) -> None:
    for weight, max_rows, packed in (
        (WEIGHTS["int8"], INT8_PACKED_MAX_ROWS, "int8pack"),
        (WEIGHTS["int4-g64"], INT4_PACKED_MAX_ROWS, "int4pack"),
    ):
        layer = QuantLinear(weight)
        assert layer.kernel_for(1).name == packed
        assert layer.kernel_for(max_rows).name == packed
        assert layer.kernel_for(max_rows + 1).name == "dequant"


@pytest.mark.parametrize(
    "weight",
    [
        quantize_int8(WEIGHT, 32),  # grouped int8: torch has no kernel
        quantize_int4(torch.randn(40, 256), 32),  # 40 output channels: not a multiple of 16
        quantize_int4(torch.randn(32, 96), 48),  # a group size the int4 kernel does not take
    ],
    ids=["int8-grouped", "int4-odd-out", "int4-g48"],
)
def test_weights_without_a_kernel_fall_back_to_dequantize(
    weight: QuantizedWeight, torch_packed_only
) -> None:
    assert not has_packed_kernel(weight, CPU)
    assert [c.kernel.name for c in plan_kernels(weight, CPU)] == ["dequant"]
    x = torch.randn(3, weight.in_features)
    torch.testing.assert_close(QuantLinear(weight)(x), x @ weight.dequantize().T, rtol=0, atol=1e-5)


def test_other_devices_get_the_dequantize_path() -> None:
    assert not has_packed_kernel(WEIGHTS["int8"], torch.device("cuda"))
    assert not has_packed_kernel(WEIGHTS["int4-g64"], torch.device("meta"))


def test_quant_linear_keeps_shape_dtype_and_bias() -> None:
    weight = WEIGHTS["int4-g64"]
    bias = torch.randn(96)
    layer = QuantLinear(weight, bias)
    x = torch.randn(2, 3, 256)
    out = layer(x)
    assert out.shape == (2, 3, 96) and out.dtype == torch.float32
    torch.testing.assert_close(out, x @ weight.dequantize().T + bias, rtol=0, atol=0.05)
    big = torch.randn(4, 20, 256)  # 80 rows: the int4 kernel's prefill schedule, same bits per row
    torch.testing.assert_close(layer(big), big @ weight.dequantize().T + bias, rtol=0, atol=0.05)
    assert torch.equal(layer(big)[1, 7], layer(big[1, 7:8])[0])
    assert QuantLinear(weight)(x.to(torch.bfloat16)).dtype == torch.bfloat16
    assert "int4 g64" in repr(layer) and f"{layer.kernel_for(1).name}<=" in repr(layer)


def test_pinned_kernels_are_used() -> None:
    weight = WEIGHTS["int8"]
    layer = QuantLinear(weight, kernels=(KernelChoice(float("inf"), DequantizedMatmul(weight)),))
    assert layer.kernel_for(1).name == "dequant"
    torch.testing.assert_close(
        layer(X[:1]), F.linear(X[:1], weight.dequantize()), rtol=0, atol=1e-5
    )


@pytest.mark.parametrize("name", ["int8", "int4-g32"])
def test_quant_embedding_looks_up_dequantized_rows(name: str) -> None:
    weight = WEIGHTS[name]
    embedding = QuantEmbedding(weight, torch.float32)
    ids = torch.tensor([[3, 0], [95, 3]])
    out = embedding(ids)
    assert out.shape == (2, 2, 256)
    assert torch.equal(out, weight.dequantize()[ids])
    assert QuantEmbedding(weight, torch.bfloat16)(ids).dtype == torch.bfloat16


def test_dequantize_path_expands_large_weights_a_slice_at_a_time() -> None:
    weight = quantize_int4(
        torch.randn(20_000, 64, generator=GENERATOR), 32
    )  # more rows than one slice holds
    kernel = DequantizedMatmul(weight)
    assert kernel.rows_per_slice < weight.out_features
    x = torch.randn(3, 64, generator=GENERATOR)
    torch.testing.assert_close(kernel(x), x @ weight.dequantize().T, rtol=0, atol=1e-5)


@requires(need_cpu_kernels)
@pytest.mark.parametrize("name", ["int8", "int4-g32", "int4-g64"])
def test_plan_prefers_rebars_cpu_kernels_for_every_batch(name: str) -> None:
    weight = WEIGHTS[name]
    layer = QuantLinear(weight)
    assert layer.kernel_for(1).name == "native" and layer.kernel_for(4096).name == "native"
    assert len(layer.kernels) == 1  # no fallback: the kernels serve prefill-sized steps too
    x = X[:5]
    reference = x.double() @ weight.dequantize(torch.float64).T
    # int8 activations per block of 32: about 1% of each output's scale
    assert (layer(x).double() - reference).abs().max() < 0.02 * reference.abs().max()
    assert torch.equal(layer(X[:1]), layer(X[:17])[:1])  # a row's bits do not depend on the batch
    assert torch.equal(
        layer(X[:1]), layer(torch.cat([X, X]))[:1]
    )  # nor on the schedule (64+ rows: the prefill one)
    assert layer(x.to(torch.bfloat16)).dtype == torch.bfloat16


@requires(need_cpu_kernels)
def test_native_operands_are_what_the_linear_multiplies_with() -> None:
    weight = WEIGHTS["int4-g64"]
    bias = torch.randn(96)
    layer = QuantLinear(weight, bias)
    operands = layer.native_operands()
    assert operands is not None and layer.decode_kernel_name == "native"
    assert operands.max_rows == float("inf")
    assert operands.bias is not None and operands.bias.dtype == torch.float32
    assert torch.equal(operands.bias, bias)
    x = X[:3]
    direct = cpu_quant.linear_packed(x, operands.packed) + operands.bias
    assert torch.equal(direct, layer(x))


def test_no_native_operands_when_another_kernel_serves_decode_rows() -> None:
    weight = WEIGHTS["int8"]
    layer = QuantLinear(weight, kernels=(KernelChoice(float("inf"), DequantizedMatmul(weight)),))
    assert layer.native_operands() is None and layer.decode_kernel_name == "dequant"
