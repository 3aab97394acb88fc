"""The Triton int8/int4 matmuls, run on Triton's CPU interpreter, against x @ dequantized(W).T,
alone and as the quantized linear's kernel for rebar's formats on CUDA.

The reference dequantizes the weights here, independently of the kernels, and multiplies in
float64. N and K are chosen so that tiles run past the matrix edges.
"""

from __future__ import annotations

import math
from types import ModuleType

import pytest
import torch
from interpreted_triton import import_interpreted

from rebar.weights.int_formats import quantize_int4, quantize_int8
from rebar.weights.qlinear import (
    KernelChoice,
    QuantLinear,
    TritonMatmul,
    has_triton_kernel,
    plan_kernels,
)


@pytest.fixture(scope="module")
def kernels() -> ModuleType | None:
    """The kernel module, interpreted; None when the tests must run in a subprocess (conftest.py)."""
    return import_interpreted("rebar.kernels.triton_quant_matmul")


def make_int8(
    num_out: int, num_in: int, group_size: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    qweight = torch.randint(-127, 128, (num_out, num_in), generator=gen, dtype=torch.int8)
    scales = torch.rand(num_out, num_in // group_size, generator=gen) * 0.01 + 0.002
    return qweight, scales


def dequantize_int8(qweight: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    return qweight.double() * scales.double().repeat_interleave(group_size, dim=1)


def make_int4(num_out: int, num_in: int, group_size: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (num_out, num_in // 2), generator=gen, dtype=torch.uint8)
    scales = torch.rand(num_out, num_in // group_size, generator=gen) * 0.02 + 0.005
    offsets = -8 * scales + torch.randn(num_out, num_in // group_size, generator=gen) * 0.01
    return packed, scales, offsets


def dequantize_int4(
    packed: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, group_size: int
) -> torch.Tensor:
    low, high = (packed & 0xF).double(), (packed >> 4).double()
    q = torch.stack([low, high], dim=-1).reshape(packed.shape[0], -1)  # column 2j low, 2j + 1 high
    return q * scales.double().repeat_interleave(
        group_size, 1
    ) + offsets.double().repeat_interleave(group_size, 1)


def random_x(num_rows: int, num_in: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(num_rows, num_in, generator=torch.Generator().manual_seed(seed)).to(dtype)


def assert_matches(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == dtype and out.shape == expected.shape
    if dtype == torch.float32:
        # fp32 accumulation over a few hundred terms of size ~0.1.
        torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    else:
        # Dominated by rounding the output to 16 bits (the interpreter truncates bf16: up to one
        # ulp).
        eps = torch.finfo(dtype).eps
        torch.testing.assert_close(out.double(), expected, rtol=eps, atol=eps)


@pytest.mark.parametrize("num_rows", [1, 5, 33])
def test_int8_per_output_channel(kernels: ModuleType, num_rows: int) -> None:
    """One scale per row of W (group_size == K); K = 100 ends in a partial tile, N = 72 too."""
    qweight, scales = make_int8(72, 100, group_size=100, seed=num_rows)
    x = random_x(num_rows, 100, torch.float32, seed=num_rows)
    out = kernels.int8_matmul(x, qweight, scales, 100)
    assert_matches(out, x.double() @ dequantize_int8(qweight, scales, 100).T, torch.float32)


@pytest.mark.parametrize("num_rows", [1, 33])
def test_int8_grouped(kernels: ModuleType, num_rows: int) -> None:
    qweight, scales = make_int8(40, 128, group_size=32, seed=7)
    x = random_x(num_rows, 128, torch.float32, seed=8)
    out = kernels.int8_matmul(x, qweight, scales, 32)
    assert_matches(out, x.double() @ dequantize_int8(qweight, scales, 32).T, torch.float32)


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("num_rows", [1, 5, 33])
def test_int4_grouped(kernels: ModuleType, group_size: int, num_rows: int) -> None:
    packed, scales, offsets = make_int4(40, 256, group_size, seed=group_size)
    x = random_x(num_rows, 256, torch.float32, seed=num_rows)
    out = kernels.int4_matmul(x, packed, scales, offsets, group_size)
    assert_matches(
        out, x.double() @ dequantize_int4(packed, scales, offsets, group_size).T, torch.float32
    )


def test_int4_one_group_per_row_with_a_partial_tile(kernels: ModuleType) -> None:
    packed, scales, offsets = make_int4(24, 100, 100, seed=3)
    x = random_x(5, 100, torch.float32, seed=3)
    out = kernels.int4_matmul(x, packed, scales, offsets, 100)
    assert_matches(out, x.double() @ dequantize_int4(packed, scales, offsets, 100).T, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs(kernels: ModuleType, dtype: torch.dtype) -> None:
    x = random_x(5, 128, dtype, seed=4)
    qweight, scales = make_int8(40, 128, group_size=64, seed=4)
    expected = x.double() @ dequantize_int8(qweight, scales, 64).T
    assert_matches(kernels.int8_matmul(x, qweight, scales, 64), expected, dtype)
    packed, scales, offsets = make_int4(40, 128, 32, seed=5)
    expected = x.double() @ dequantize_int4(packed, scales, offsets, 32).T
    assert_matches(kernels.int4_matmul(x, packed, scales, offsets, 32), expected, dtype)


def test_strided_input_rows(kernels: ModuleType) -> None:
    """x may be a view (e.g. every other row of a larger batch)."""
    x = random_x(10, 64, torch.float32, seed=6)[::2]
    packed, scales, offsets = make_int4(16, 64, 32, seed=6)
    out = kernels.int4_matmul(x, packed, scales, offsets, 32)
    assert_matches(out, x.double() @ dequantize_int4(packed, scales, offsets, 32).T, torch.float32)


def test_no_rows_gives_an_empty_output(kernels: ModuleType) -> None:
    qweight, scales = make_int8(8, 64, 64, seed=0)
    assert kernels.int8_matmul(torch.empty(0, 64), qweight, scales, 64).shape == (0, 8)


def test_unsupported_shapes_raise(kernels: ModuleType) -> None:
    x = torch.zeros(2, 96)
    qweight, scales = make_int8(8, 96, 96, seed=0)
    with pytest.raises(ValueError, match="must divide"):
        kernels.int8_matmul(x, qweight, torch.ones(8, 2), 40)
    with pytest.raises(ValueError, match="multiple of 32"):
        kernels.int8_matmul(x, qweight, torch.ones(8, 4), 24)
    with pytest.raises(ValueError, match="scales must be"):
        kernels.int8_matmul(x, qweight, torch.ones(8, 2), 96)
    with pytest.raises(ValueError, match="x must be"):
        kernels.int8_matmul(torch.zeros(2, 64), qweight, scales, 96)
    with pytest.raises(ValueError, match=r"torch\.int8"):
        kernels.int8_matmul(x, qweight.to(torch.int16), scales, 96)
    packed, scales4, offsets = make_int4(8, 96, 32, seed=0)
    with pytest.raises(ValueError, match=r"torch\.uint8"):
        kernels.int4_matmul(x, packed.to(torch.int8), scales4, offsets, 32)
    with pytest.raises(ValueError, match="offsets shape"):
        kernels.int4_matmul(x, packed, scales4, offsets[:, :1], 32)
    with pytest.raises(ValueError, match="float16, bfloat16 or float32"):
        kernels.int4_matmul(x.double(), packed, scales4, offsets, 32)


QUANTIZED = {
    "int8-per-channel": lambda w: quantize_int8(w),
    "int8-g64": lambda w: quantize_int8(w, 64),
    "int4-g32": lambda w: quantize_int4(w, 32),
    "int4-g128": lambda w: quantize_int4(w, 128),
}


@pytest.mark.parametrize("name", list(QUANTIZED))
def test_quant_linear_runs_rebars_formats_through_the_kernels(
    kernels: ModuleType, name: str
) -> None:
    """The quantized linear's CUDA kernel, here on CPU tensors under the interpreter."""
    gen = torch.Generator().manual_seed(11)
    weight = QUANTIZED[name](torch.randn(40, 256, generator=gen) * 0.05)
    bias = torch.randn(40, generator=gen)
    layer = QuantLinear(weight, bias, kernels=(KernelChoice(math.inf, TritonMatmul(weight)),))
    x = torch.randn(2, 3, 256, generator=gen)
    out = layer(x)
    expected = x.double() @ weight.dequantize(torch.float64).T + bias.double()
    assert out.shape == (2, 3, 40) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    unbiased = QuantLinear(weight, kernels=layer.kernels)
    assert unbiased(x.to(torch.bfloat16)).dtype == torch.bfloat16


def test_cuda_plans_choose_the_kernels_for_rebars_formats(kernels: ModuleType) -> None:
    """Planning reads only the weight's format, so a CPU weight stands in for a CUDA one."""
    cuda = torch.device("cuda")
    gen = torch.Generator().manual_seed(12)
    w = torch.randn(16, 96, generator=gen)
    for weight in (quantize_int8(w), quantize_int4(w, 32)):
        assert has_triton_kernel(weight, cuda)
        assert [c.kernel.name for c in plan_kernels(weight, cuda)] == ["triton"]
        assert not has_triton_kernel(weight, torch.device("cpu"))
    odd_groups = quantize_int4(w, 48)  # straddles the kernels' 32-wide K tiles
    assert not has_triton_kernel(odd_groups, cuda)
    assert [c.kernel.name for c in plan_kernels(odd_groups, cuda)] == ["dequant"]
