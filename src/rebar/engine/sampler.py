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

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from rebar.engine.sampling_params import SamplingParams
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
    if mask is None and all(_is_plain_greedy(r.params) for r in requests):
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
        cut = _Thresholds(
            chosen,
            params,
            _column([_log_min_p(p) for p in params], chosen),
            _whole_masses(chosen, params),
            chosen.shape[1],  # the whole vocabulary: every cut exact
        )
        scaled = _scaled(chosen, params)
        weights = scaled.exp().masked_fill_(scaled < cut.values, 0.0).double()
        probabilities[rows] = weights / weights.sum(-1, keepdim=True)
    return probabilities


def token_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, requests: Sequence[SampleRequest]
) -> list[TokenLogprobs | None]:
    """Each row's log-probabilities for `token_ids` ([rows]), as `sample_batch` reports them (None
    for rows that did not ask)."""
    return _logprobs(logits, token_ids, requests)


def _is_plain_greedy(params: SamplingParams) -> bool:
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
        token_ids[sampled] = _draw(
            processed[sampled],
            [requests[i] for i in sampled],
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
    _add_logit_bias(processed, [r.params for r in requests])
    if penalised:
        _apply_penalties(processed, [requests[i] for i in penalised], penalised)
    if mask is None:
        return processed, {}
    return processed, dict(zip(mask.rows, mask.apply_(processed), strict=True))


def _add_logit_bias(logits: torch.Tensor, params: Sequence[SamplingParams]) -> None:
    """Add every row's logit_bias in place, in one indexed add over the batch."""
    rows: list[int] = []
    columns: list[int] = []
    values: list[float] = []
    for row, p in enumerate(params):
        if p.logit_bias:
            rows.extend([row] * len(p.logit_bias))
            columns.extend(p.logit_bias.keys())
            values.extend(p.logit_bias.values())
    if not rows:
        return
    if max(columns) >= logits.shape[1]:
        raise ValueError(
            f"logit_bias names token {max(columns)} beyond the vocabulary of {logits.shape[1]}"
        )
    device = logits.device
    index = (torch.tensor(rows, device=device), torch.tensor(columns, device=device))
    logits.index_put_(
        index, torch.tensor(values, dtype=logits.dtype, device=device), accumulate=True
    )


def _token_counts(
    histories: Sequence[Sequence[int]], rows: Sequence[int], vocab_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct (row, token) pairs of the histories as flat ids row * vocab_size + token, and
    their counts.

    `histories[j]` belongs to row `rows[j]`. Costs time in the history length, not the vocabulary.
    """
    token_ids = torch.tensor(
        list(itertools.chain.from_iterable(histories)), dtype=torch.long, device=device
    )
    if token_ids.numel() and (int(token_ids.min()) < 0 or int(token_ids.max()) >= vocab_size):
        raise ValueError(f"token history holds an id outside [0, {vocab_size})")
    lengths = torch.tensor([len(h) for h in histories], device=device)
    row_ids = torch.repeat_interleave(
        torch.tensor(list(rows), dtype=torch.long, device=device), lengths
    )
    return torch.unique(row_ids * vocab_size + token_ids, return_counts=True)


def _apply_penalties(
    logits: torch.Tensor, requests: Sequence[SampleRequest], rows: Sequence[int]
) -> None:
    """Repetition (prompt and output), then presence and frequency (output only) penalties, in
    place.

    `requests[j]` is row `rows[j]` of `logits` ([rows, vocab], contiguous); only logits of tokens
    in a history are read or written.
    """
    vocab_size, device = logits.shape[1], logits.device
    flat = logits.view(-1)
    output_ids, output_counts = _token_counts(
        [r.output_token_ids for r in requests], rows, vocab_size, device
    )

    def per_row(values: list[float], flat_ids: torch.Tensor) -> torch.Tensor:
        by_row = torch.zeros(logits.shape[0], dtype=logits.dtype, device=device)
        by_row[list(rows)] = torch.tensor(values, dtype=logits.dtype, device=device)
        return by_row[flat_ids // vocab_size]

    repetition = [r.params.repetition_penalty for r in requests]
    if any(p != 1.0 for p in repetition):
        prompt_ids, _ = _token_counts(
            [r.prompt_token_ids for r in requests], rows, vocab_size, device
        )
        seen = torch.unique(torch.cat([prompt_ids, output_ids]))
        penalty, values = per_row(repetition, seen), flat[seen]
        flat[seen] = torch.where(values > 0, values / penalty, values * penalty)
    presence = per_row([r.params.presence_penalty for r in requests], output_ids)
    frequency = per_row([r.params.frequency_penalty for r in requests], output_ids)
    flat[output_ids] = flat[output_ids] - (presence + frequency * output_counts.to(logits.dtype))


# Rows with top_k or top_p look for their kept set among their best tokens, this many first, then
# more; only a row whose kept set reaches past the widest sorts its whole vocabulary.
CANDIDATE_WIDTHS = (64, 1024)


def _draw(
    logits: torch.Tensor, requests: Sequence[SampleRequest], allowed: dict[int, int] | None = None
) -> torch.Tensor:
    """One token id per row ([rows]) of `logits` ([rows, vocab], bias, penalties and masks
    applied); `allowed[row]` is how many tokens a masked row's grammar still allows.

    A row with top_k or top_p whose kept set lies within its best CANDIDATE_WIDTHS tokens draws
    among those, and so does a masked row whose allowed tokens fit in one (a grammar often allows
    a handful, and exp over a row of -inf is slow); every other row draws over its whole
    vocabulary. Either way it draws the same token from the same uniform: the cumulative
    distribution runs over the kept tokens in token-id order, and a dropped token adds exactly 0
    to it. So which width settles a row, and which rows share a width, changes nothing but the
    time taken.
    """
    allowed = allowed or {}
    params = [r.params for r in requests]
    uniforms = _uniforms([r.generator for r in requests], logits.device)
    vocab_size = logits.shape[1]
    thresholds = _column([_log_min_p(p) for p in params], logits)  # [rows, 1]; min_p alone so far
    masses = _whole_masses(logits, params)
    token_ids = torch.empty(len(requests), dtype=torch.long, device=logits.device)
    pending = [i for i, p in enumerate(params) if _narrows(p, vocab_size)]
    # Masked rows that do not narrow: tried only at the width their allowed tokens fit in.
    fitting = {
        i: next((w for w in CANDIDATE_WIDTHS if count < w), None)
        for i, count in allowed.items()
        if not _narrows(params[i], vocab_size)
    }
    settled_masked: set[int] = set()
    for width in CANDIDATE_WIDTHS:
        rows = [i for i in pending if params[i].top_k <= width or params[i].top_k >= vocab_size]
        rows += [i for i, w in fitting.items() if w == width]
        if not rows:
            continue
        cut = _Thresholds(
            logits[rows], [params[i] for i in rows], thresholds[rows], masses[rows], width
        )
        fit = [j for j, ok in enumerate(cut.exact.tolist()) if ok]
        if fit:
            token_ids[[rows[j] for j in fit]] = _draw_in_token_order(cut, fit, uniforms[rows])
            settled = {rows[j] for j in fit}
            pending = [i for i in pending if i not in settled]
            settled_masked |= settled & set(fitting)
    unsettled = [
        i for i, p in enumerate(params) if not _narrows(p, vocab_size) and i not in settled_masked
    ]
    whole = sorted(pending + unsettled)
    if whole:
        token_ids[whole] = _draw_over_vocabulary(
            logits, params, thresholds, masses, uniforms, pending, whole
        )
    return token_ids


def _draw_over_vocabulary(
    logits: torch.Tensor,
    params: list[SamplingParams],
    thresholds: torch.Tensor,
    masses: torch.Tensor,
    uniforms: torch.Tensor,
    pending: list[int],
    whole: list[int],
) -> torch.Tensor:
    """Token ids for the rows `whole`, each drawn over its whole vocabulary; the `pending` rows
    (narrowed by top_k/top_p past every candidate width) get their thresholds from a full sort."""
    if pending:
        wide = [params[i] for i in pending]
        vocab_size = logits.shape[1]
        cut = _Thresholds(logits[pending], wide, thresholds[pending], masses[pending], vocab_size)
        thresholds[pending] = cut.values
    scaled = _scaled(logits[whole], [params[i] for i in whole], in_place=True)
    weights = scaled.exp()
    if pending or any(params[i].min_p > 0.0 for i in whole):
        weights.masked_fill_(scaled < thresholds[whole], 0.0)
    return _invert_cdf(weights, uniforms[whole])


def _narrows(params: SamplingParams, vocab_size: int) -> bool:
    return 0 < params.top_k < vocab_size or params.top_p < 1.0


def _log_min_p(params: SamplingParams) -> float:
    """min_p as a threshold on scaled logits shifted so the best one is 0 (a probability ratio)."""
    return math.log(params.min_p) if params.min_p > 0.0 else -math.inf


def _column(values: Sequence[float], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=like.dtype, device=like.device).unsqueeze(1)  # [rows, 1]


def _scaled(
    logits: torch.Tensor, params: Sequence[SamplingParams], in_place: bool = False
) -> torch.Tensor:
    """(logits - row max) / temperature, so every row's best logit is exactly 0; `in_place`
    overwrites `logits` (a caller's private copy) instead of allocating.

    Shifting leaves the distribution unchanged and keeps a tiny temperature from overflowing to
    inf (which would turn the probabilities into NaN).
    """
    temperatures = _column([p.temperature for p in params], logits)
    maxima = logits.amax(-1, keepdim=True)
    if in_place:
        return logits.sub_(maxima).div_(temperatures)
    return (logits - maxima) / temperatures


class _Thresholds:
    """Each row's keep threshold, found among its best `width` tokens.

    `values` ([rows, 1]) is the threshold on scaled logits, holding min_p, top_k and top_p; `exact`
    ([rows] bool) says the kept set lies within `candidates` ([rows, width] scaled logits, best
    first; their token ids in `candidate_ids`), always so when `width` covers the vocabulary. A cut
    the candidates cannot settle (top_k past them, a nucleus reaching past them) is left out of
    `values`, which then counts only where it already drops the last candidate. `min_p` is the
    rows' min_p threshold and `masses` their whole mass, from _whole_masses (both [rows, 1]).
    """

    def __init__(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        min_p: torch.Tensor,
        masses: torch.Tensor,
        width: int,
    ) -> None:
        vocab_size = logits.shape[1]
        width = min(width, vocab_size)
        best, self.candidate_ids = logits.topk(width, dim=-1)
        temperatures = _column([p.temperature for p in params], logits)
        self.candidates = (best - best[:, :1]) / temperatures  # [rows, width], the same as _scaled
        top_k = torch.tensor(
            [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params],
            device=logits.device,
        ).unsqueeze(1)  # [rows, 1]
        has_top_k = top_k < vocab_size
        kth = self.candidates.gather(1, top_k.clamp(max=width) - 1)
        top_k_cut = torch.where(has_top_k & (top_k <= width), kth, -math.inf)
        last = self.candidates[:, -1:]
        complete = width == vocab_size
        # The last candidate is -inf (masked): every token the row may take is a candidate.
        holds_all = torch.isneginf(last)
        self.values = torch.maximum(top_k_cut, min_p)
        fits = (last < self.values) | holds_all
        if any(p.top_p < 1.0 for p in params):
            has_top_p = torch.tensor([[p.top_p < 1.0] for p in params], device=logits.device)
            # top_p measures mass within what top_k kept: known when the candidates hold all of it.
            mass_known = ~has_top_k | complete | (last < top_k_cut) | holds_all
            top_p_cut = self._top_p_cut(params, has_top_k, top_k_cut, masses, complete)
            top_p_cut = torch.where(has_top_p & mass_known, top_p_cut, -math.inf)
            self.values = torch.maximum(self.values, top_p_cut)
            fits = ((last < self.values) | holds_all) & (mass_known | ~has_top_p)
        self.exact = (fits | complete).squeeze(1)

    def _top_p_cut(
        self,
        params: Sequence[SamplingParams],
        has_top_k: torch.Tensor,
        top_k_cut: torch.Tensor,
        masses: torch.Tensor,
        complete: bool,
    ) -> torch.Tensor:
        """The scaled logit of the last token top_p keeps [rows, 1]; -inf where that token may lie
        past the candidates (and meaningless where the row's mass is not known)."""
        # top_k rows measure their nucleus within their own top k; the others use their whole mass.
        weights = self.candidates.exp().masked_fill_(self.candidates < top_k_cut, 0.0)
        cdf = torch.cumsum(weights, -1, dtype=torch.float64)  # [rows, width]
        totals = torch.where(has_top_k, cdf[:, -1:], masses)
        top_p = torch.tensor([[p.top_p] for p in params], dtype=torch.float64, device=cdf.device)
        # A token is dropped once the tokens ranked before it hold top_p, so the best always stays.
        num_kept = 1 + (cdf[:, :-1] < top_p * totals).sum(-1, keepdim=True)
        cut = self.candidates.gather(1, num_kept - 1)
        return cut if complete else torch.where(num_kept < cdf.shape[1], cut, -math.inf)


def _whole_masses(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """sum(exp(scaled logits)) over the whole row [rows, 1] float64 for top_p rows without top_k,
    the mass their nucleus is measured against (1 for the other rows, which do not use it)."""
    totals = torch.ones(len(params), 1, dtype=torch.float64, device=logits.device)
    vocab_size = logits.shape[1]
    rows = [j for j, p in enumerate(params) if p.top_p < 1.0 and not 0 < p.top_k < vocab_size]
    if rows:
        weights = _scaled(logits[rows], [params[j] for j in rows], in_place=True).exp_()
        totals[rows] = _row_sums(weights)
    return totals


SUM_BLOCK = 1024


def _row_sums(values: torch.Tensor) -> torch.Tensor:
    """[rows, 1] float64 sums of `values` ([rows, n]), each the same bits alone or in any batch.

    A plain sum() of a lone long row is split across threads, so its round-off differs from the
    same row's in a batch. Blocks of SUM_BLOCK values, each summed by one thread, then added in
    order, give every row one summation order.
    """
    width = values.shape[1] // SUM_BLOCK * SUM_BLOCK
    blocks = values[:, :width].unflatten(1, (-1, SUM_BLOCK)).sum(-1, dtype=torch.float64)
    tail = values[:, width:].sum(-1, keepdim=True, dtype=torch.float64)
    return torch.cat([blocks, tail], 1).cumsum(-1)[:, -1:]


def _draw_in_token_order(cut: _Thresholds, rows: list[int], uniforms: torch.Tensor) -> torch.Tensor:
    """Token ids for `rows` of `cut` (exact ones) drawn among their kept candidates, in token-id
    order."""
    values, ids, thresholds = cut.candidates, cut.candidate_ids, cut.values
    if len(rows) < len(values):
        values, ids, thresholds, uniforms = (
            values[rows],
            ids[rows],
            thresholds[rows],
            uniforms[rows],
        )
    keep = values >= thresholds
    after_every_id = torch.iinfo(ids.dtype).max
    order = torch.where(keep, ids, after_every_id).argsort(-1)  # kept tokens by id, then dropped
    weights = values.exp().masked_fill_(~keep, 0.0).gather(1, order)
    positions = _invert_cdf(weights, uniforms).unsqueeze(1)
    return ids.gather(1, order.gather(1, positions)).squeeze(1)


def _invert_cdf(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Column index per row drawn in proportion to `weights` ([rows, n], each row's sum positive),
    using one uniform in [0, 1) per row."""
    cdf = torch.cumsum(
        weights, -1, dtype=torch.float64
    )  # float64 keeps rare tokens distinguishable
    total = cdf[:, -1:]
    # Stay strictly below the total, so the search always lands on a token with positive mass.
    target = torch.minimum(
        uniforms.unsqueeze(1) * total, torch.nextafter(total, torch.zeros_like(total))
    )
    return torch.searchsorted(cdf, target, right=True).squeeze(1)


def advance_generator(generator: torch.Generator, num_rows: int) -> None:
    """Move `generator` on by what `num_rows` sampled rows draw from it (one uniform each)."""
    for _ in range(num_rows):
        _draw_uniform(generator)


def _draw_uniform(generator: torch.Generator) -> torch.Tensor:
    return torch.rand((), dtype=torch.float64, generator=generator, device=generator.device)


def _uniforms(generators: Sequence[torch.Generator | None], device: torch.device) -> torch.Tensor:
    """One uniform [0, 1) float64 per row: seeded rows from their own generator, the rest from the
    global RNG."""
    uniforms = torch.empty(len(generators), dtype=torch.float64)
    unseeded = [row for row, generator in enumerate(generators) if generator is None]
    if unseeded:
        uniforms[unseeded] = torch.rand(len(unseeded), dtype=torch.float64)
    for row, generator in enumerate(generators):
        if generator is not None:
            uniforms[row] = _draw_uniform(generator).cpu()
    return uniforms.to(device)


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
