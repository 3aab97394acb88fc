"""Turn logits into tokens: greedy, or temperature with top-k / top-p / min-p filters.

`sample_batch` is what the engine calls once per step for every running request. It makes one
pass over the batch, each stage a batched tensor operation on the rows that need it:

1. logit_bias, then repetition, presence and frequency penalties, then the step's grammar mask
   (tokens a row's grammar forbids become -inf);
2. greedy rows (temperature 0) take the argmax of what stage 1 left;
3. sampled rows divide by their temperature and keep the tokens that top_k, top_p and min_p all
   allow, expressed as one threshold per row: a token is kept when its scaled logit reaches it;
4. each sampled row draws one uniform number from its own generator and inverts the cumulative
   distribution of its kept tokens, taken in token-id order;
5. rows that asked for them get their log-probabilities.

Stage 1's bias and penalties live in `rebar.engine.logit_penalties`, stages 3 and 4 in
`rebar.engine.token_draw`; this module runs the stages and owns what callers see.

The fast path: a batch whose rows are all greedy without logit_bias, penalties or a grammar is one
argmax.

What the filters keep: top_k the k best tokens and every token tied with the k-th; top_p, within
what top_k kept, the best tokens until those ranked before the next one hold top_p of that mass
(always the best one), and every token tied with the last kept one; min_p the tokens whose
probability is at least min_p times the best token's.

A row whose logits cannot be sampled (NaN anywhere, or no finite best value: a broken model, or
bias and penalties that overflowed) gets None instead of a token, and the other rows are not
affected: one request's numbers can never make another fail.

Log-probabilities are always the log-softmax of the raw model logits, before logit_bias, penalties,
temperature and filters (as vLLM reports them by default), so they describe the model, not the
sampling settings.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from rebar.engine.logit_penalties import add_logit_bias, apply_penalties
from rebar.engine.sampling_params import SamplingParams
from rebar.engine.token_draw import (
    Thresholds,
    column,
    draw,
    log_min_p,
    scaled_logits,
    whole_masses,
)
from rebar.kernels.best_logits import best_logits


@dataclass
class SampleRequest:
    """One row of a sampling batch: the settings and token history of one sequence."""

    params: SamplingParams
    generator: torch.Generator | None  # from make_generator(params); None = the global RNG
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]


@dataclass(frozen=True)
class TokenLogprobs:
    """The chosen token's log-probability and the best alternatives, from the raw model logits.

    `top` holds (token_id, logprob) pairs, most likely first; its length is `params.logprobs`
    (capped at the vocabulary size). The chosen token is reported in `token_id`/`logprob` whether
    or not it appears in `top`.
    """

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclass(frozen=True)
class SampledToken:
    """The token picked for one row; `logprobs` is None unless the row's params asked for them."""

    token_id: int
    logprobs: TokenLogprobs | None


class LogitsMask(Protocol):
    """Forbidden tokens of some rows, applied to the sampler's own copy of the logits."""

    rows: list[int]

    def apply_(self, logits: torch.Tensor) -> list[int]:
        """Mask in place; returns how many tokens each of `rows` still allows."""
        ...


def make_generator(params: SamplingParams) -> torch.Generator | None:
    """A private RNG for a seeded request, so its tokens do not depend on other requests."""
    if params.greedy or params.seed is None:
        return None
    generator = torch.Generator(device="cpu")
    generator.manual_seed(params.seed)
    return generator


def sample_batch(
    logits: torch.Tensor, requests: Sequence[SampleRequest], mask: LogitsMask | None = None
) -> list[SampledToken | None]:
    """Pick one token per row of `logits` ([len(requests), vocab] float32); see the module
    docstring.

    Callers may rely on: the caller's `logits` tensor is not modified; every token id returned is in
    [0, vocab); a row gets None when its raw or processed logits hold NaN or no finite best value; a
    row's result depends only on its own logits, params, token history and generator, never on the
    other rows, so a seeded row draws the same tokens alone or in any batch; each sampled
    (non-greedy) row consumes exactly one float64 uniform from its generator (or, without one, from
    the global CPU RNG) per call, unless it gets None; greedy rows consume none. A row that `mask`
    names only ever gets a token its mask allows (None when it allows none).
    """
    if logits.dim() != 2 or logits.shape[0] != len(requests):
        raise ValueError(f"logits must be [{len(requests)}, vocab], got {list(logits.shape)}")
    if mask is None and all(is_plain_greedy(r.params) for r in requests):
        # Fast path: nothing to add, scale or draw.
        token_ids, valid = best_logits(logits)
    else:
        token_ids, valid = _sample_rows(logits, requests, mask)
    # Checked on every row: argmax of a NaN row would otherwise return a plausible id.
    valid &= (token_ids >= 0) & (token_ids < logits.shape[1])
    token_ids = torch.where(valid, token_ids, 0)
    logprobs = _logprobs(logits, token_ids, requests)
    return [
        SampledToken(t, lp) if ok else None
        for t, lp, ok in zip(token_ids.tolist(), logprobs, valid.tolist())
    ]


def distributions(
    logits: torch.Tensor, requests: Sequence[SampleRequest], mask: LogitsMask | None = None
) -> torch.Tensor:
    """[rows, vocab] float64: the probability with which `sample_batch` would draw each token for
    each row (a greedy row: 1 on its argmax). Rows whose logits cannot be sampled get all zeros."""
    processed, _ = _processed(logits, requests, mask)
    best, valid = _best_and_valid(logits, processed)
    probabilities = torch.zeros(processed.shape, dtype=torch.float64, device=logits.device)
    greedy = [i for i, r in enumerate(requests) if r.params.greedy and bool(valid[i])]
    if greedy:
        probabilities[greedy, best[greedy]] = 1.0
    rows = [i for i, r in enumerate(requests) if not r.params.greedy and bool(valid[i])]
    if rows:
        params = [requests[i].params for i in rows]
        chosen = processed[rows]
        cut = Thresholds(
            chosen,
            params,
            column([log_min_p(p) for p in params], chosen),
            whole_masses(chosen, params),
            chosen.shape[1],  # the whole vocabulary: every cut exact
        )
        scaled = scaled_logits(chosen, params)
        weights = scaled.exp().masked_fill_(scaled < cut.values, 0.0).double()
        probabilities[rows] = weights / weights.sum(-1, keepdim=True)
    return probabilities


def token_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, requests: Sequence[SampleRequest]
) -> list[TokenLogprobs | None]:
    """Each row's log-probabilities for `token_ids` ([rows]), as `sample_batch` reports them (None
    for rows that did not ask)."""
    return _logprobs(logits, token_ids, requests)


def is_plain_greedy(params: SamplingParams) -> bool:
    """Greedy with nothing added to the logits first: the row's token is their argmax."""
    return params.greedy and params.logit_bias is None and not params.has_penalties


def _best_and_valid(
    logits: torch.Tensor, processed: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each processed row's best token [rows], and whether the row can be sampled [rows]: bias and
    penalties can overflow a row that was fine, and a mask can leave a row with nothing, so both
    versions need a finite best value and no NaN."""
    best, valid = best_logits(processed)
    if processed is not logits:
        valid &= best_logits(logits)[1]
    return best, valid


def _sample_rows(
    logits: torch.Tensor, requests: Sequence[SampleRequest], mask: LogitsMask | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [rows] and whether each row could be sampled [rows], for any mix of rows."""
    processed, allowed = _processed(logits, requests, mask)
    token_ids, valid = _best_and_valid(logits, processed)  # greedy rows' tokens already
    sampled = [
        i for i, (r, ok) in enumerate(zip(requests, valid.tolist())) if ok and not r.params.greedy
    ]
    if sampled:
        token_ids[sampled] = draw(
            processed[sampled],
            [requests[i].params for i in sampled],
            [requests[i].generator for i in sampled],
            {j: allowed[i] for j, i in enumerate(sampled) if i in allowed},
        )
    return token_ids, valid


def _processed(
    logits: torch.Tensor, requests: Sequence[SampleRequest], mask: LogitsMask | None
) -> tuple[torch.Tensor, dict[int, int]]:
    """Float32 logits after every row's logit_bias, penalties and mask (a new tensor, or `logits`
    itself, never written to, when it is float32 and no row has any), and how many tokens each
    masked row allows."""
    if logits.dtype != torch.float32:
        logits = logits.float()
    penalised = [i for i, r in enumerate(requests) if r.params.has_penalties]
    if mask is None and not penalised and all(r.params.logit_bias is None for r in requests):
        return logits, {}
    processed = logits.clone(memory_format=torch.contiguous_format)
    add_logit_bias(processed, [r.params for r in requests])
    if penalised:
        apply_penalties(processed, [requests[i] for i in penalised], penalised)
    if mask is None:
        return processed, {}
    return processed, dict(zip(mask.rows, mask.apply_(processed), strict=True))


def _logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, requests: Sequence[SampleRequest]
) -> list[TokenLogprobs | None]:
    """Per row, the chosen token's and the top alternatives' log-softmax of the raw logits."""
    result: list[TokenLogprobs | None] = [None] * len(requests)
    rows = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
    if not rows:
        return result
    logprobs = logits[rows].float().log_softmax(-1)
    chosen_ids = token_ids[rows]
    chosen = logprobs.gather(1, chosen_ids.unsqueeze(1)).squeeze(1).tolist()
    num_top = min(max(requests[i].params.logprobs or 0 for i in rows), logits.shape[1])
    top_values, top_ids = logprobs.topk(num_top, dim=-1)
    value_rows, id_rows, chosen_id_list = top_values.tolist(), top_ids.tolist(), chosen_ids.tolist()
    for j, row in enumerate(rows):
        k = requests[row].params.logprobs or 0
        top = tuple(zip(id_rows[j][:k], value_rows[j][:k]))
        result[row] = TokenLogprobs(chosen_id_list[j], chosen[j], top)
    return result
