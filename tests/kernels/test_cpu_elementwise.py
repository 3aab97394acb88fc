"""The compiled SiLU-and-multiply and RoPE (rebar.kernels.cpu_elementwise) against float64
references."""

from __future__ import annotations

import pytest
import torch
from tests.kernels.cpu_quant_helpers import require_kernels

from rebar.kernels import cpu_elementwise
from rebar.kernels.cpu_elementwise import reference_rope
from rebar.kernels.cpu_quant.build import load_extension
from rebar.model.rope import rope_cos_sin


@pytest.fixture
def extension():
    require_kernels()
    return load_extension().module


def rope_inputs(tokens: int, heads: int, head_dim: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, heads, head_dim, generator=gen) * 3
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    positions = torch.randint(0, 4000, (tokens,), generator=gen)
    cos, sin = rope_cos_sin(inv_freq.float(), positions, torch.float32)
    return x, cos, sin


# Sizes around the vector width (8) and past the thread grain (16,384 values), so both the tail
# and a split over threads are covered.
@pytest.mark.parametrize("shape", [(1, 3), (2, 8), (5, 1536), (40, 1536), (7, 13)])
def test_silu_and_mul_matches_float64(extension, shape):
    gen = torch.Generator().manual_seed(1)
    gate = torch.randn(shape, generator=gen) * 6
    up = torch.randn(shape, generator=gen)
    gate[0, 0], up[0, 0] = -100.0, 1.0  # e^100: the exponent's clamp must not give NaN
    out = extension.silu_and_mul(gate, up)
    expected = torch.nn.functional.silu(gate.double()) * up.double()
    assert out.shape == gate.shape and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), expected, rtol=2e-6, atol=1e-12)


def test_silu_and_mul_is_the_same_however_it_is_split(extension):
    """A row's values do not depend on which thread (or vector/tail path) computed them."""
    gen = torch.Generator().manual_seed(2)
    gate, up = torch.randn(70_001, generator=gen), torch.randn(70_001, generator=gen)
    whole = extension.silu_and_mul(gate, up)
    pieces = torch.cat(
        [extension.silu_and_mul(gate[i : i + 13], up[i : i + 13]) for i in range(0, 70_001, 13)]
    )
    assert torch.equal(whole, pieces)


def test_silu_and_mul_reads_non_contiguous_inputs(extension):
    gen = torch.Generator().manual_seed(3)
    both = torch.randn(6, 64, generator=gen)
    gate, up = both[:, :32], both[:, 32:]
    torch.testing.assert_close(
        extension.silu_and_mul(gate, up), torch.nn.functional.silu(gate) * up
    )


@pytest.mark.parametrize(
    ("tokens", "heads", "head_dim"), [(1, 1, 2), (3, 9, 64), (100, 3, 64), (33, 2, 10)]
)
def test_rope_matches_reference(extension, tokens, heads, head_dim):
    x, cos, sin = rope_inputs(tokens, heads, head_dim)
    expected = reference_rope(x.double(), cos.double(), sin.double())
    rotated = x.clone()
    extension.rope_(rotated, cos, sin)
    torch.testing.assert_close(rotated.double(), expected, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize(
    ("make_args", "message"),
    [
        (lambda x, c, s: (x.double(), c, s), "float32"),
        (lambda x, c, s: (x.transpose(0, 1), c, s), "contiguous"),
        (lambda x, c, s: (x, c[:-1], s[:-1]), "cos and sin"),
        (
            lambda x, c, s: (x[..., :63], c[:, :63].contiguous(), s[:, :63].contiguous()),
            "even head_dim",
        ),
    ],
)
def test_rope_rejects_bad_arguments(extension, make_args, message):
    x, cos, sin = rope_inputs(4, 3, 64)
    with pytest.raises(ValueError, match=message):
        extension.rope_(*make_args(x, cos, sin))


def test_silu_and_mul_rejects_mismatched_shapes(extension):
    with pytest.raises(ValueError, match="differ in shape"):
        extension.silu_and_mul(torch.zeros(2, 8), torch.zeros(2, 9))


def test_dispatch_uses_the_compiled_ops_once_loaded(extension):
    x, cos, sin = rope_inputs(8, 3, 64)
    original = x.clone()
    rotated = cpu_elementwise.apply_rope(x, cos, sin)
    assert rotated.data_ptr() == x.data_ptr()  # the compiled op rotates in place
    torch.testing.assert_close(rotated, reference_rope(original, cos, sin), rtol=1e-6, atol=1e-5)
    gate, up = torch.randn(4, 16), torch.randn(4, 16)
    torch.testing.assert_close(
        cpu_elementwise.silu_and_mul(gate, up), torch.nn.functional.silu(gate) * up
    )


@pytest.mark.parametrize("case", ["float64", "requires_grad", "non-contiguous"])
def test_dispatch_falls_back_to_torch(extension, case):
    """Tensors the compiled ops do not serve take the torch reference, which returns a new tensor
    (and, for autograd, keeps the graph)."""
    x, cos, sin = rope_inputs(8, 3, 64)
    if case == "float64":
        x, cos, sin = x.double(), cos.double(), sin.double()
    elif case == "requires_grad":
        x.requires_grad_(True)
    else:
        x = x.transpose(0, 1).contiguous().transpose(0, 1)
    rotated = cpu_elementwise.apply_rope(x, cos, sin)
    assert rotated.data_ptr() != x.data_ptr()
    torch.testing.assert_close(rotated, reference_rope(x, cos, sin))
    if case == "requires_grad":
        assert rotated.requires_grad
        gate = torch.randn(4, 16, requires_grad=True)
        out = cpu_elementwise.silu_and_mul(gate, torch.randn(4, 16))
        out.sum().backward()
        assert gate.grad is not None


def test_dispatch_never_builds_the_extension():
    """In a process that has not loaded rebar's CPU kernels, the torch path runs and nothing loads."""
    import subprocess
    import sys

    script = (
        "import rebar, torch\n"
        "from rebar.kernels import cpu_elementwise\n"
        "from rebar.kernels.cpu_quant.build import loaded_extension\n"
        "x, c = torch.randn(2, 1, 4), torch.ones(2, 4)\n"
        "out = cpu_elementwise.apply_rope(x, c, torch.zeros(2, 4))\n"
        "cpu_elementwise.silu_and_mul(x, x)\n"
        "print(out.data_ptr() != x.data_ptr(), loaded_extension() is None)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    )
    assert result.stdout.split() == ["True", "True"]
