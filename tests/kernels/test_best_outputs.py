"""Each row's best output of a packed linear found without writing the outputs
(`cpu_quant.best_outputs`): what `best_logits(linear_packed(x, w))` finds, for every weight kind,
every schedule the rows take, ties across spans and chunks, NaN and infinities."""

from __future__ import annotations

import pytest
import torch
from cpu_quant_helpers import KINDS, random_activations, random_kind, require_kernels
from test_cpu_quant_kinds import affine4

from rebar.kernels import cpu_quant
from rebar.kernels.best_logits import best_logits
from suite_tiers import limit

pytestmark = limit("kernel_build")  # tests/suite_tiers.py

# 588 tiles, the last one partial: every thread chunk (8 at 2 threads) spans two spans of 64 tiles.
OUT, IN = 4701, 256


@pytest.fixture(scope="module", autouse=True)
def cpu_kernels() -> None:
    require_kernels()


def packed_of(kind: str, out_f: int, gen: torch.Generator) -> cpu_quant.PackedQuant:
    if kind.startswith("affine4"):
        return affine4(out_f, IN, gen, torch.float32 if kind.endswith("f32") else torch.float16)
    return random_kind(kind, out_f, IN, gen).packed


def assert_same_best(x: torch.Tensor, packed: cpu_quant.PackedQuant) -> None:
    expected_index, expected_valid = best_logits(cpu_quant.linear_packed(x, packed))
    index, valid = cpu_quant.best_outputs(x, packed)
    assert index.dtype == torch.long and valid.dtype == torch.bool
    assert torch.equal(valid, expected_valid)
    assert torch.equal(index[valid], expected_index[valid])


@pytest.mark.parametrize("kind", [*KINDS, "affine4", "affine4_f32"])
def test_every_kind_and_row_count_finds_the_written_outputs_best(kind: str) -> None:
    """1 and 5 rows take the small-batch kernel, 6-31 the paired tiles, 32+ the prefill schedule
    (on torch's threads from 64)."""
    gen = torch.Generator().manual_seed(5)
    packed = packed_of(kind, OUT, gen)
    x = random_activations(70, IN, gen)
    for rows in (1, 5, 6, 17, 31, 32, 70):
        assert_same_best(x[:rows], packed)


def test_ties_go_to_the_first_output_across_spans_and_chunks() -> None:
    """Outputs 2, 700 (another span of the same chunk) and 4000 (another chunk) are the same
    weights and the largest for a positive row: the first of them is the best. Zero activations
    make every output 0: output 0 is."""
    gen = torch.Generator().manual_seed(9)
    codes = torch.randint(0, 256, (OUT, IN), generator=gen, dtype=torch.uint8)
    codes[[2, 700, 4000]] = 255
    scales = torch.full((OUT, IN // 32), 1e-3).half()
    packed = cpu_quant.pack_sym(codes, 8, scales, 32, 128)
    x = torch.rand(3, IN, generator=gen) + 0.1
    x[1] = 0.0
    index, valid = cpu_quant.best_outputs(x, packed)
    assert index.tolist() == [2, 0, 2] and valid.all()
    assert_same_best(x, packed)


def test_nan_anywhere_and_infinite_bests_are_not_valid() -> None:
    """A NaN output in a late chunk spoils its row (the best found elsewhere is no answer). Without
    it, clean rows stay valid, and rows with a NaN or an infinite activation get what the written
    outputs give (the activation quantizer decides what those become)."""
    gen = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 256, (OUT, IN), generator=gen, dtype=torch.uint8)
    scales = torch.full((OUT, IN // 32), 1e-3).half()
    scales[4321, 0] = float("nan")
    packed = cpu_quant.pack_sym(codes, 8, scales, 32, 128)
    x = torch.randn(4, IN, generator=gen)
    x[2, 0] = float("inf")
    x[3, 0] = float("nan")
    _, valid = cpu_quant.best_outputs(x, packed)
    assert valid.tolist() == [False, False, False, False]  # output 4321 is NaN for every row
    assert_same_best(x, packed)
    clean = cpu_quant.pack_sym(codes, 8, torch.full((OUT, IN // 32), 1e-3).half(), 32, 128)
    assert cpu_quant.best_outputs(x, clean)[1][:2].tolist() == [True, True]
    assert_same_best(x, clean)


def test_bad_input_raises_value_error() -> None:
    packed = random_kind("sym8", 64, IN, torch.Generator().manual_seed(1)).packed
    for x in (torch.randn(2, IN + 1), torch.randn(IN), torch.randn(2, IN).double()):
        with pytest.raises(ValueError):
            cpu_quant.best_outputs(x, packed)
    index, valid = cpu_quant.best_outputs(torch.randn(0, IN), packed)
    assert index.shape == valid.shape == (0,)
