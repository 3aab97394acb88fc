"""Turn one row of logits into a token: greedy, or temperature with top-k / top-p / min-p filters."""

from __future__ import annotations

import torch

from rebar.engine.sampling_params import SamplingParams


def make_generator(params: SamplingParams) -> torch.Generator | None:
    """A private RNG for a seeded request, so its tokens do not depend on other requests."""
    if params.greedy or params.seed is None:
        return None
    generator = torch.Generator(device="cpu")
    generator.manual_seed(params.seed)
    return generator


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature-scaled logits ([vocab] float32) with filtered-out tokens set to -inf."""
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        # Drop a token when the tokens ranked before it already reach top_p.
        drop_sorted = (cumulative - sorted_logits.softmax(-1)) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    if params.min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    return logits


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Pick the next token from [vocab] float32 logits."""
    if params.greedy:
        return int(torch.argmax(logits))
    probs = filter_logits(logits, params).softmax(-1)
    return int(torch.multinomial(probs, 1, generator=generator))
