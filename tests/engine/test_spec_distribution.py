"""Sampled output with speculative decoding follows the model's distribution, checked statistically.

Two drafters: the model's own greedy continuation (a point-mass draft: kept with the probability
the sampled token equals it), and drafts sampled from a different distribution q (a cooler
temperature over fewer tokens, so some tokens the model may draw are never drafted) checked by
rejection sampling proper. Each generates three tokens for 3000 seeded requests, checked against the model's exact
distribution by chi-square (tests/spec_stats.py).
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Sequence

import pytest
import torch

from rebar.engine.core import EngineCore
from rebar.engine.scheduler import ScheduledRequest
from rebar.engine.spec.policy import StepCost
from rebar.engine.spec.speculator import Drafting, Speculator
from spec_stats import NUM_DRAWS, chi_square_p_value, draw, exact_distribution
from tiny_engine import make_core


class MemoLogits:
    """The model's teacher-forced logits after a context, each context computed once (the draws
    revisit a few dozen)."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.seen: dict[tuple[int, ...], torch.Tensor] = {}

    def __call__(self, tokens: list[int]) -> torch.Tensor:
        key = tuple(tokens)
        if key not in self.seen:
            self.seen[key] = self.core.logits(tokens)[-1]
        return self.seen[key]


class SampledDrafter:
    """Drafts drawn from q: the model's distribution at temperature 0.8 over its 4 best tokens."""

    name = "sampled"

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.logits = MemoLogits(core)
        self.generator = torch.Generator().manual_seed(99)

    def outlook(self, sequence: Drafting, max_tokens: int) -> int:
        tokens = list(sequence.request.token_ids)
        chances = []
        for _ in range(max_tokens):
            values, ids = self.logits(tokens).double().topk(4)
            chance = torch.zeros(self.core.runner.config.vocab_size, dtype=torch.float64)
            chance[ids] = torch.softmax(values / 0.8, -1)
            tokens.append(int(torch.multinomial(chance, 1, generator=self.generator)))
            chances.append(chance)
        sequence.speculation.planned = tuple(tokens[sequence.request.num_tokens :])
        sequence.speculation.draft_probabilities = torch.stack(chances)
        return max_tokens

    def draft(self, batch: Sequence[tuple[Drafting, ScheduledRequest]]) -> list[tuple[int, ...]]:
        return [sequence.speculation.planned[: item.num_lookahead] for sequence, item in batch]


class GreedySelfDrafter:
    """Drafts the model's own greedy continuation (from teacher-forced logits)."""

    name = "greedy-self"

    def __init__(self, core: EngineCore) -> None:
        self.logits = MemoLogits(core)

    def outlook(self, sequence: Drafting, max_tokens: int) -> int:
        tokens = list(sequence.request.token_ids)
        for _ in range(max_tokens):
            tokens.append(int(self.logits(tokens).argmax()))
        sequence.speculation.planned = tuple(tokens[sequence.request.num_tokens :])
        return max_tokens

    def draft(self, batch: Sequence[tuple[Drafting, ScheduledRequest]]) -> list[tuple[int, ...]]:
        return [sequence.speculation.planned[: item.num_lookahead] for sequence, item in batch]


@pytest.mark.parametrize("drafter_class", [GreedySelfDrafter, SampledDrafter])
def test_speculative_sampling_follows_the_model_distribution(tmp_path, drafter_class) -> None:
    core = make_core(tmp_path, max_num_seqs=64, num_blocks=512)
    drafter = drafter_class(core)
    core.speculator = Speculator(drafter, StepCost([(1, 1.0), (2, 1.0)]), max_draft_tokens=2)
    exact = exact_distribution(core)
    assert abs(sum(exact.values()) - 1.0) < 1e-9

    observed = draw(core)
    counts = core.stats().drafts[drafter.name]
    # Both verdicts happened often: drafts were kept and refused.
    assert counts.num_accepted > 500 and counts.num_drafted - counts.num_accepted > 500
    assert chi_square_p_value(observed, exact, NUM_DRAWS) > 1e-6
    total_variation = 0.5 * sum(
        abs(observed[c] / NUM_DRAWS - exact.get(c, 0.0)) for c in set(exact) | set(observed)
    )
    assert total_variation < 0.12  # the sampling noise of 3000 draws over these cells is ~0.07


def test_the_chi_square_check_rejects_a_slightly_skewed_sampler(tmp_path) -> None:
    """Control: draws from the exact distribution pass, the same draws with the likeliest
    continuation 4% more often (the commonest others each one fewer) fail."""
    core = make_core(tmp_path)
    exact = exact_distribution(core)
    generator = torch.Generator().manual_seed(1)
    continuations = list(exact)
    picks = torch.multinomial(
        torch.tensor([exact[c] for c in continuations]), NUM_DRAWS, True, generator=generator
    )
    observed = Counter(continuations[i] for i in picks.tolist())
    assert chi_square_p_value(observed, exact, NUM_DRAWS) > 1e-6
    likeliest = max(exact, key=exact.__getitem__)
    skewed = Counter(observed)
    moved = int(0.04 * NUM_DRAWS)
    skewed[likeliest] += moved
    others = sorted((c for c in skewed if c != likeliest), key=skewed.__getitem__, reverse=True)
    for continuation in itertools.islice(others, moved):
        skewed[continuation] -= 1
    assert chi_square_p_value(skewed, exact, NUM_DRAWS) < 1e-6
