"""Drawing one token for each sampled row (stages 3 and 4 of `rebar.engine.sampler`): the keep
threshold that top_k, top_p and min_p together set on a row's temperature-scaled logits, and one
uniform number inverting the cumulative distribution of the kept tokens, taken in token-id order.

A row's draw depends only on its own logits, settings and generator: every sum that decides it is
taken in one order whatever the batch (`row_sums`), and which candidate width settles a row changes
nothing but the time taken (`draw`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from rebar.engine.sampling_params import SamplingParams

# Rows with top_k or top_p look for their kept set among their best tokens, this many first, then
# more; only a row whose kept set reaches past the widest sorts its whole vocabulary.
CANDIDATE_WIDTHS = (64, 1024)


def draw(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    allowed: dict[int, int] | None = None,
) -> torch.Tensor:
    """One token id per row ([rows]) of `logits` ([rows, vocab], bias, penalties and masks
    applied), drawn with the row's `params` and one uniform from its generator (None: the global
    RNG); `allowed[row]` is how many tokens a masked row's grammar still allows.

    A row with top_k or top_p whose kept set lies within its best CANDIDATE_WIDTHS tokens draws
    among those, and so does a masked row whose allowed tokens fit in one (a grammar often allows
    a handful, and exp over a row of -inf is slow); every other row draws over its whole
    vocabulary. Either way it draws the same token from the same uniform: the cumulative
    distribution runs over the kept tokens in token-id order, and a dropped token adds exactly 0
    to it. So which width settles a row, and which rows share a width, changes nothing but the
    time taken.
    """
    allowed = allowed or {}
    uniforms = _uniforms(generators, logits.device)
    vocab_size = logits.shape[1]
    thresholds = column([log_min_p(p) for p in params], logits)  # [rows, 1]; min_p alone so far
    masses = whole_masses(logits, params)
    token_ids = torch.empty(len(params), dtype=torch.long, device=logits.device)
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
        cut = Thresholds(
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
    params: Sequence[SamplingParams],
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
        cut = Thresholds(logits[pending], wide, thresholds[pending], masses[pending], vocab_size)
        thresholds[pending] = cut.values
    scaled = scaled_logits(logits[whole], [params[i] for i in whole], in_place=True)
    weights = scaled.exp()
    if pending or any(params[i].min_p > 0.0 for i in whole):
        weights.masked_fill_(scaled < thresholds[whole], 0.0)
    return _invert_cdf(weights, uniforms[whole])


def _narrows(params: SamplingParams, vocab_size: int) -> bool:
    return 0 < params.top_k < vocab_size or params.top_p < 1.0


def log_min_p(params: SamplingParams) -> float:
    """min_p as a threshold on scaled logits shifted so the best one is 0 (a probability ratio)."""
    return math.log(params.min_p) if params.min_p > 0.0 else -math.inf


def column(values: Sequence[float], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=like.dtype, device=like.device).unsqueeze(1)  # [rows, 1]


def scaled_logits(
    logits: torch.Tensor, params: Sequence[SamplingParams], in_place: bool = False
) -> torch.Tensor:
    """(logits - row max) / temperature, so every row's best logit is exactly 0; `in_place`
    overwrites `logits` (a caller's private copy) instead of allocating.

    Shifting leaves the distribution unchanged and keeps a tiny temperature from overflowing to
    inf (which would turn the probabilities into NaN).
    """
    temperatures = column([p.temperature for p in params], logits)
    maxima = logits.amax(-1, keepdim=True)
    if in_place:
        return logits.sub_(maxima).div_(temperatures)
    return (logits - maxima) / temperatures


class Thresholds:
    """Each row's keep threshold, found among its best `width` tokens.

    `values` ([rows, 1]) is the threshold on scaled logits, holding min_p, top_k and top_p; `exact`
    ([rows] bool) says the kept set lies within `candidates` ([rows, width] scaled logits, best
    first; their token ids in `candidate_ids`), always so when `width` covers the vocabulary. A cut
    the candidates cannot settle (top_k past them, a nucleus reaching past them) is left out of
    `values`, which then counts only where it already drops the last candidate. `min_p` is the
    rows' min_p threshold and `masses` their whole mass, from whole_masses (both [rows, 1]).
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
        temperatures = column([p.temperature for p in params], logits)
        self.candidates = (best - best[:, :1]) / temperatures  # [rows, width], as scaled_logits
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


def whole_masses(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """sum(exp(scaled logits)) over the whole row [rows, 1] float64 for top_p rows without top_k,
    the mass their nucleus is measured against (1 for the other rows, which do not use it)."""
    totals = torch.ones(len(params), 1, dtype=torch.float64, device=logits.device)
    vocab_size = logits.shape[1]
    rows = [j for j, p in enumerate(params) if p.top_p < 1.0 and not 0 < p.top_k < vocab_size]
    if rows:
        weights = scaled_logits(logits[rows], [params[j] for j in rows], in_place=True).exp_()
        totals[rows] = row_sums(weights)
    return totals


SUM_BLOCK = 1024


def row_sums(values: torch.Tensor) -> torch.Tensor:
    """[rows, 1] float64 sums of `values` ([rows, n]), each the same bits alone or in any batch.

    A plain sum() of a lone long row is split across threads, so its round-off differs from the
    same row's in a batch. Blocks of SUM_BLOCK values, each summed by one thread, then added in
    order, give every row one summation order.
    """
    width = values.shape[1] // SUM_BLOCK * SUM_BLOCK
    blocks = values[:, :width].unflatten(1, (-1, SUM_BLOCK)).sum(-1, dtype=torch.float64)
    tail = values[:, width:].sum(-1, keepdim=True, dtype=torch.float64)
    return torch.cat([blocks, tail], 1).cumsum(-1)[:, -1:]


def _draw_in_token_order(cut: Thresholds, rows: list[int], uniforms: torch.Tensor) -> torch.Tensor:
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
