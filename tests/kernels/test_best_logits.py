"""Each row's best logit (rebar.kernels.best_logits): the compiled pass against torch's argmax and
isfinite(amax), on ties, infinities, NaN and every length around the vector width."""

from __future__ import annotations

import pytest
import torch
from tests.kernels.cpu_quant_helpers import require_kernels

from rebar.kernels import best_logits as module
from rebar.kernels.best_logits import best_logits, reference_best_logits

INF, NAN = float("inf"), float("nan")


@pytest.fixture
def compiled():
    require_kernels()
    from rebar.kernels.cpu_quant.build import load_extension

    load_extension()
    assert module.loaded_extension() is not None  # the compiled pass is what runs below
    return best_logits


@pytest.mark.parametrize("vocab", [1, 2, 7, 8, 9, 15, 16, 17, 31, 33, 1000, 49152, 262147])
def test_equals_torch_on_random_rows(compiled, vocab) -> None:
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(6, vocab, generator=gen) * 5
    index, finite = compiled(logits)
    assert index.dtype == torch.long and finite.dtype == torch.bool
    assert torch.equal(index, logits.argmax(-1))
    assert finite.all()


@pytest.mark.parametrize("vocab", [9, 24, 37, 1000])
def test_ties_go_to_the_first_index_across_lanes_and_the_tail(compiled, vocab) -> None:
    logits = torch.zeros(vocab, vocab)
    for row in range(vocab):  # the best value twice: at `row` and at the last index
        logits[row, row] = logits[row, vocab - 1] = 3.0
    index, _ = compiled(logits)
    assert index.tolist() == list(range(vocab))
    assert torch.equal(index, logits.argmax(-1))
    # Equal values everywhere: the first.
    flat = torch.full((2, vocab), 1.5)
    assert compiled(flat)[0].tolist() == [0, 0]


def test_infinities_and_nan_are_not_finite(compiled) -> None:
    vocab = 21
    logits = torch.randn(5, vocab)
    logits[0] = -INF  # nothing allowed
    logits[1, 12] = INF  # a best value that is not finite
    logits[2, 3] = NAN  # NaN before the best value
    logits[2, 5] = 100.0
    logits[3, 20] = NAN  # NaN in the tail
    logits[4, :] = -INF
    logits[4, 17] = 2.0  # one allowed token, in the tail
    index, finite = compiled(logits)
    assert finite.tolist() == [False, False, False, False, True]
    assert finite.tolist() == reference_best_logits(logits)[1].tolist()
    assert index[0] == 0 and index[1] == 12 and index[2] == 5 and index[4] == 17
    assert ((index >= 0) & (index < vocab)).all()


def test_a_strided_view_gives_the_same_answers(compiled) -> None:
    logits = torch.randn(4, 300)
    view = logits[::2, 10:290]
    assert torch.equal(compiled(view)[0], view.argmax(-1))


def test_other_inputs_take_the_torch_reference() -> None:
    logits = torch.randn(3, 50, dtype=torch.float64)
    index, finite = best_logits(logits)
    assert torch.equal(index, logits.argmax(-1)) and finite.all()
