"""The sampler's filters against hand-computed expectations, and seeded reproducibility."""

from __future__ import annotations

import math

import torch

from rebar import SamplingParams
from rebar.engine.sampler import filter_logits, make_generator, sample

LOGITS = torch.log(torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05]))


def kept(params: SamplingParams) -> list[int]:
    return torch.isfinite(filter_logits(LOGITS, params)).nonzero().flatten().tolist()


def test_greedy_takes_the_argmax() -> None:
    assert sample(torch.tensor([0.1, 3.0, -1.0]), SamplingParams(temperature=0), None) == 1


def test_top_k_keeps_k_best() -> None:
    assert kept(SamplingParams(top_k=2)) == [0, 1]
    assert kept(SamplingParams(top_k=0)) == [0, 1, 2, 3, 4]


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    assert kept(SamplingParams(top_p=0.5)) == [0, 1]  # 0.4 < 0.5, 0.4 + 0.3 >= 0.5
    assert kept(SamplingParams(top_p=0.4)) == [0]
    assert kept(SamplingParams(top_p=0.86)) == [0, 1, 2, 3]


def test_min_p_is_relative_to_the_best_token() -> None:
    assert kept(SamplingParams(min_p=0.5)) == [0, 1]  # threshold 0.2
    assert kept(SamplingParams(min_p=0.3)) == [0, 1, 2]  # threshold 0.12


def test_temperature_sharpens_and_flattens() -> None:
    cold = filter_logits(LOGITS, SamplingParams(temperature=0.5)).softmax(-1)
    hot = filter_logits(LOGITS, SamplingParams(temperature=2.0)).softmax(-1)
    assert cold[0] > 0.4 > hot[0]
    assert math.isclose(float(cold.sum()), 1.0, rel_tol=1e-6)


def test_sampling_follows_the_distribution() -> None:
    params = SamplingParams(temperature=1.0, seed=7)
    generator = make_generator(params)
    counts = torch.zeros(5)
    for _ in range(4000):
        counts[sample(LOGITS, params, generator)] += 1
    assert torch.allclose(counts / 4000, LOGITS.exp(), atol=0.03)


def test_same_seed_same_tokens_different_seed_different_tokens() -> None:
    logits = torch.randn(1000)

    def draw(seed: int) -> list[int]:
        params = SamplingParams(temperature=1.0, seed=seed)
        generator = make_generator(params)
        return [sample(logits, params, generator) for _ in range(20)]

    assert draw(1) == draw(1)
    assert draw(1) != draw(2)


def test_filtered_tokens_are_never_sampled() -> None:
    params = SamplingParams(temperature=1.0, top_k=2, seed=3)
    generator = make_generator(params)
    assert {sample(LOGITS, params, generator) for _ in range(500)} == {0, 1}
