"""The statistics of the speculative-sampling tests: the exact distribution of a tiny model's
three-token continuations, seeded draws from an engine, and a chi-square test between them.

The reference is computed independently of the sampler: the probability of every continuation from
the model's teacher-forced logits, with temperature and top-k applied by hand. The test pools
continuations expected fewer than MIN_EXPECTED times into one cell; with fixed seeds the draws are
fixed, so a threshold of p = 1e-6 cannot flake, while a sampler off by a few percent on a common
continuation fails it by a wide margin (test_spec_distribution.py's control).
"""

from __future__ import annotations

from collections import Counter

import torch

from rebar.engine.core import EngineCore
from rebar.engine.sampling_params import SamplingParams
from tiny_engine import run_to_completion, tokens_of

PROMPT = [5, 17, 33, 8, 61, 12]
TOP_K, TEMPERATURE = 6, 1.3
NUM_DRAWS = 3000
MIN_EXPECTED = 5.0  # continuations expected fewer times than this are pooled into one cell


def processed_probabilities(logits: torch.Tensor) -> torch.Tensor:
    """What sampling with TOP_K and TEMPERATURE draws from, computed by hand."""
    values, ids = logits.double().topk(TOP_K)
    probabilities = torch.zeros_like(logits, dtype=torch.float64)
    probabilities[ids] = torch.softmax(values / TEMPERATURE, -1)
    return probabilities


def exact_distribution(core: EngineCore) -> dict[tuple[int, ...], float]:
    """Probability of every three-token continuation of PROMPT (zero ones left out)."""
    exact: dict[tuple[int, ...], float] = {}
    first = processed_probabilities(core.logits(PROMPT)[-1])
    for t1 in first.nonzero().flatten().tolist():
        second = processed_probabilities(core.logits([*PROMPT, t1])[-1])
        for t2 in second.nonzero().flatten().tolist():
            third = processed_probabilities(core.logits([*PROMPT, t1, t2])[-1])
            for t3 in third.nonzero().flatten().tolist():
                exact[(t1, t2, t3)] = float(first[t1] * second[t2] * third[t3])
    return exact


def chi_square_p_value(observed: Counter, exact: dict[tuple[int, ...], float], draws: int) -> float:
    cells: list[tuple[float, float]] = []  # (observed, expected)
    pooled_observed, pooled_expected = 0.0, 0.0
    for continuation, probability in exact.items():
        expected = probability * draws
        if expected < MIN_EXPECTED:
            pooled_observed += observed[continuation]
            pooled_expected += expected
        else:
            cells.append((observed[continuation], expected))
    cells.append(
        (pooled_observed + sum(observed[c] for c in observed if c not in exact), pooled_expected)
    )
    statistic = sum((o - e) ** 2 / e for o, e in cells if e > 0)
    dof = len(cells) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), torch.tensor(statistic / 2.0)))


def draw(core: EngineCore) -> Counter:
    for seed in range(NUM_DRAWS):
        params = SamplingParams(
            max_tokens=3, temperature=TEMPERATURE, top_k=TOP_K, seed=seed, ignore_eos=True
        )
        core.add_request(str(seed), PROMPT, params)
    return Counter(tuple(tokens_of(outputs)) for outputs in run_to_completion(core).values())
