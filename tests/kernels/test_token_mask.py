"""Token bitmasks applied to logits (rebar.kernels.token_mask): the compiled kernel against the
torch reference, and the reference against the bits themselves."""

from __future__ import annotations

import pytest
import torch
from tests.kernels.cpu_quant_helpers import require_kernels

from rebar.kernels import token_mask
from rebar.kernels.cpu_quant.build import load_extension
from rebar.kernels.token_mask import bitmask_words, reference_apply_token_bitmask_


def random_bitmask(rows: int, vocab: int, seed: int) -> torch.Tensor:
    """Words of every kind a grammar writes: all allowed, none allowed, and mixed."""
    gen = torch.Generator().manual_seed(seed)
    words = torch.randint(-(2**31), 2**31 - 1, (rows, bitmask_words(vocab)), generator=gen)
    kind = torch.randint(0, 3, words.shape, generator=gen)
    words = torch.where(kind == 0, torch.full_like(words, -1), words)
    words = torch.where(kind == 1, torch.zeros_like(words), words)
    return words.to(torch.int32)


def allowed_by_bits(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, vocab] bool, bit by bit in plain Python ints."""
    out = torch.zeros(bitmask.shape[0], vocab, dtype=torch.bool)
    for r, row in enumerate(bitmask.tolist()):
        for t in range(vocab):
            out[r, t] = bool((row[t // 32] & 0xFFFFFFFF) >> (t % 32) & 1)
    return out


@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 97, 1000])
def test_reference_forbids_exactly_the_clear_bits(vocab) -> None:
    bitmask = random_bitmask(3, vocab, seed=vocab)
    logits = torch.randn(5, vocab)
    original = logits.clone()
    counts = reference_apply_token_bitmask_(logits, bitmask, [4, 0, 2])
    allowed = allowed_by_bits(bitmask, vocab)
    assert counts == allowed.sum(-1).tolist()
    for j, row in enumerate([4, 0, 2]):
        assert torch.equal(logits[row][allowed[j]], original[row][allowed[j]])
        assert torch.isneginf(logits[row][~allowed[j]]).all()
    assert torch.equal(logits[[1, 3]], original[[1, 3]])  # rows not named are untouched


@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 4099, 49152, 262144])
def test_compiled_kernel_equals_the_reference(vocab) -> None:
    require_kernels()
    load_extension()
    bitmask = random_bitmask(4, vocab, seed=7)
    logits = torch.randn(6, vocab)
    expected = logits.clone()
    expected_counts = reference_apply_token_bitmask_(expected, bitmask, [5, 1, 0, 3])
    counts = token_mask.apply_token_bitmask_(logits, bitmask, [5, 1, 0, 3])
    assert torch.equal(logits, expected)
    assert counts == expected_counts


def test_compiled_kernel_refuses_bad_arguments() -> None:
    require_kernels()
    extension = load_extension().module
    logits = torch.randn(2, 64)
    with pytest.raises(ValueError, match="words"):
        extension.mask_logits_(logits, torch.zeros(1, 1, dtype=torch.int32), torch.tensor([0]))
    with pytest.raises(ValueError, match="outside"):
        extension.mask_logits_(logits, torch.zeros(1, 2, dtype=torch.int32), torch.tensor([2]))
    with pytest.raises(ValueError, match="int32"):
        extension.mask_logits_(logits, torch.zeros(1, 2, dtype=torch.int64), torch.tensor([0]))
