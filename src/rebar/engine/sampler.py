"""Turn logits into tokens: greedy, or temperature with top-k / top-p / min-p filters.

`sample_batch` is what the engine calls once per step for every running request. Per row it
applies, in order: logit_bias -> repetition, presence and frequency penalties -> greedy argmax when
temperature is 0, else temperature -> top_k -> top_p -> min_p -> a draw from the row's own
generator. `process_logits` exposes the first two stages; `filter_logits` is the single-row
form of the filters (without bias or penalties).

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

import torch

from rebar.engine.sampling_params import SamplingParams


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


def make_generator(params: SamplingParams) -> torch.Generator | None:
    """A private RNG for a seeded request, so its tokens do not depend on other requests."""
    if params.greedy or params.seed is None:
        return None
    generator = torch.Generator(device="cpu")
    generator.manual_seed(params.seed)
    return generator


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature-scaled logits ([vocab] float32) with filtered-out tokens set to -inf."""
    return _filter_rows(logits.unsqueeze(0), [params]).squeeze(0)


def sample_batch(
    logits: torch.Tensor, requests: Sequence[SampleRequest]
) -> list[SampledToken | None]:
    """Pick one token per row of `logits` ([len(requests), vocab] float32); see the module docstring.

    Callers may rely on: the caller's `logits` tensor is not modified; every token id returned is in
    [0, vocab); a row gets None when its raw or processed logits hold NaN or no finite best value; a
    row's result depends only on its own logits, params, token history and generator, never on the
    other rows, so a seeded row draws the same tokens alone or in any batch; each sampled
    (non-greedy) row consumes exactly one float64 uniform from its generator (or, without one, from
    the global CPU RNG) per call, unless it gets None; greedy rows consume none.
    """
    _check_shape(logits, requests)
    token_ids = torch.full((len(requests),), -1, dtype=torch.long, device=logits.device)
    plain = [i for i, r in enumerate(requests) if _is_plain_greedy(r.params)]
    if len(plain) == len(requests):
        token_ids = logits.argmax(-1)
    elif plain:
        token_ids[plain] = logits[plain].argmax(-1)
    rest = [i for i, r in enumerate(requests) if not _is_plain_greedy(r.params)]
    if rest:
        token_ids[rest] = _sample_processed(logits[rest].float(), [requests[i] for i in rest])
    # Checked last, on every row: argmax of a NaN row would otherwise return a plausible id.
    valid = _has_finite_best(logits) & (token_ids >= 0) & (token_ids < logits.shape[1])
    token_ids = torch.where(valid, token_ids, 0)
    logprobs = _logprobs(logits, token_ids, requests)
    return [
        SampledToken(t, lp) if ok else None
        for t, lp, ok in zip(token_ids.tolist(), logprobs, valid.tolist())
    ]


def _has_finite_best(logits: torch.Tensor) -> torch.Tensor:
    """[rows] bool: the row holds no NaN and its best logit is finite (amax propagates NaN)."""
    return torch.isfinite(logits.amax(-1))


def _check_shape(logits: torch.Tensor, requests: Sequence[SampleRequest]) -> None:
    if logits.dim() != 2 or logits.shape[0] != len(requests):
        raise ValueError(f"logits must be [{len(requests)}, vocab], got {list(logits.shape)}")


def _is_plain_greedy(params: SamplingParams) -> bool:
    return params.greedy and params.logit_bias is None and not params.has_penalties


def process_logits(logits: torch.Tensor, requests: Sequence[SampleRequest]) -> torch.Tensor:
    """Each row's logits after its logit_bias and penalties, before temperature and filters.

    Returns a new float32 tensor shaped like `logits` ([len(requests), vocab]); the input is untouched.
    """
    _check_shape(logits, requests)
    processed = logits.float().clone(memory_format=torch.contiguous_format)
    _process_in_place(processed, requests)
    return processed


def _process_in_place(logits: torch.Tensor, requests: Sequence[SampleRequest]) -> None:
    assert logits.is_contiguous()  # penalties index it as one flat vector
    _add_logit_bias(logits, [r.params for r in requests])
    penalised = [i for i, r in enumerate(requests) if r.params.has_penalties]
    if penalised:
        _apply_penalties(logits, [requests[i] for i in penalised], penalised)


def _sample_processed(logits: torch.Tensor, requests: Sequence[SampleRequest]) -> torch.Tensor:
    """Token ids [rows] (-1: none) for rows that need bias, penalties or sampling; `logits` is a private copy."""
    _process_in_place(logits, requests)
    token_ids = torch.full((len(requests),), -1, dtype=torch.long, device=logits.device)
    # Rows left without a finite best logit keep id -1 (no token): drawing from them is undefined.
    usable = _has_finite_best(logits).tolist()
    greedy = [i for i, r in enumerate(requests) if usable[i] and r.params.greedy]
    if greedy:
        token_ids[greedy] = logits[greedy].argmax(-1)
    sampled = [i for i, r in enumerate(requests) if usable[i] and not r.params.greedy]
    if sampled:
        token_ids[sampled] = _draw(logits[sampled], [requests[i] for i in sampled])
    return token_ids


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
    """The distinct (row, token) pairs of the histories as flat ids row * vocab_size + token, and their counts.

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
    """Repetition (prompt and output), then presence and frequency (output only) penalties, in place.

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


def _column(values: Sequence[float], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=like.dtype, device=like.device).unsqueeze(1)  # [rows, 1]


def _filter_rows(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Temperature-scaled logits [rows, vocab] with each row's top-k/top-p/min-p losers set to -inf."""
    logits = logits / _column([p.temperature for p in params], logits)
    return _mask_min_p(_top_k_top_p(logits, params), params)


def _mask_min_p(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Mask tokens whose probability is below min_p times the row's best (a ratio, so a logit gap)."""
    if all(p.min_p == 0.0 for p in params):
        return logits
    log_min_p = _column([math.log(p.min_p) if p.min_p > 0.0 else -math.inf for p in params], logits)
    return logits.masked_fill(logits < logits.amax(-1, keepdim=True) + log_min_p, float("-inf"))


def _top_k_top_p(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Mask each row's tokens below its k-th best logit, then those outside its top-p nucleus."""
    if not any(_narrows(p, logits.shape[1]) for p in params):
        return logits
    # A stable sort keeps ties in token order, so a row sorts the same way in any batch.
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True, stable=True)
    sorted_logits = _mask_sorted(sorted_logits, params, logits.shape[1])
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _narrows(params: SamplingParams, vocab_size: int) -> bool:
    return 0 < params.top_k < vocab_size or params.top_p < 1.0


def _mask_sorted(
    sorted_logits: torch.Tensor,
    params: Sequence[SamplingParams],
    vocab_size: int,
    total: torch.Tensor | None = None,
) -> torch.Tensor:
    """Apply top-k then top-p to logits sorted best first ([rows, n], n <= vocab_size).

    When the n columns are only each row's best candidates, their best logit must be 0 and `total`
    ([rows, 1]) must be the sum of exp(logit) over the whole row; rows with top_k <= n then
    normalise over their own top k instead.
    """
    ks = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
    ks = torch.tensor(ks, device=sorted_logits.device).unsqueeze(1)  # [rows, 1]
    num_columns = sorted_logits.shape[1]
    kth = sorted_logits.gather(1, ks.clamp(max=num_columns) - 1)
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if all(p.top_p >= 1.0 for p in params):
        return sorted_logits
    if total is None:
        probs = sorted_logits.softmax(-1)
    else:
        weights = sorted_logits.exp()
        probs = weights / torch.where(ks <= num_columns, weights.sum(-1, keepdim=True), total)
    # Rows without top-p get an unreachable threshold, so round-off never trims their tail.
    top_p = _column([p.top_p if p.top_p < 1.0 else math.inf for p in params], probs)
    # Drop a token when the tokens ranked before it already reach top_p. The best token always
    # stays: a top_p that rounds to 0 in float32 would otherwise drop every token.
    drop = (probs.cumsum(-1) - probs) >= top_p
    drop[:, 0] = False
    return sorted_logits.masked_fill(drop, float("-inf"))


def _draw(logits: torch.Tensor, requests: Sequence[SampleRequest]) -> torch.Tensor:
    """One token per row [rows] from its filtered distribution, using only the row's own generator.

    Each row draws one uniform number and inverts its cumulative distribution. Rows with top-k or
    top-p first look at their best CANDIDATE_WIDTHS tokens and sort the whole vocabulary only when
    the kept set may reach past them; which path a row takes depends on that row alone.
    """
    params = [r.params for r in requests]
    uniforms = _uniforms([r.generator for r in requests], logits.device)
    token_ids = torch.empty(len(requests), dtype=torch.long, device=logits.device)
    full: list[int] = []
    by_width: dict[int, list[int]] = {}
    for i, p in enumerate(params):
        width = _candidate_width(p, logits.shape[1])
        if width is None:
            full.append(i)
        else:
            by_width.setdefault(width, []).append(i)
    for width, rows in by_width.items():
        found, fallback = _draw_from_candidates(
            logits[rows], [params[i] for i in rows], uniforms[rows], width
        )
        exact = [j for j in range(len(rows)) if j not in fallback]
        token_ids[[rows[j] for j in exact]] = found[exact]
        full += [rows[j] for j in fallback]
    if full:
        rows = sorted(full)
        row_params = [params[i] for i in rows]
        kept = _top_k_top_p(_scaled(logits[rows], row_params), row_params)
        token_ids[rows] = _invert_cdf(_mask_min_p(kept, row_params), uniforms[rows])
    return token_ids


CANDIDATE_WIDTHS = (64, 1024)
NUM_CANDIDATES = CANDIDATE_WIDTHS[-1]


def _candidate_width(params: SamplingParams, vocab_size: int) -> int | None:
    """How many best tokens may hold this row's kept set; None when it needs the whole vocabulary."""
    if not _narrows(params, vocab_size):
        return None
    if 0 < params.top_k < vocab_size:
        return next((w for w in CANDIDATE_WIDTHS if params.top_k <= w), None)
    return NUM_CANDIDATES


def _scaled(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """(logits - row max) / temperature, so every row's best logit is exactly 0.

    Shifting leaves the distribution unchanged and keeps a tiny temperature from overflowing to
    inf (which would turn the probabilities into NaN).
    """
    return (logits - logits.amax(-1, keepdim=True)) / _column(
        [p.temperature for p in params], logits
    )


def _draw_from_candidates(
    logits: torch.Tensor, params: Sequence[SamplingParams], uniforms: torch.Tensor, width: int
) -> tuple[torch.Tensor, list[int]]:
    """A token id per row drawn among its best `width` tokens, and the rows where that was not exact.

    The ids of those fallback rows are meaningless; the caller must sample them over the whole
    vocabulary. Only top-p rows without top-k can fall back: their candidates may hold less than
    top_p of the mass.
    """
    vocab_size = logits.shape[1]
    values, candidate_ids = logits.topk(min(width, vocab_size), dim=-1)  # best first
    values = _scaled(values, params)  # the row max is the first candidate
    # Rows without top-k normalise over the whole vocabulary; the others over their own top k.
    whole = [j for j, p in enumerate(params) if not 0 < p.top_k < vocab_size]
    total = torch.ones(len(params), 1, dtype=values.dtype, device=values.device)
    if whole:
        total[whole] = (
            _scaled(logits[whole], [params[j] for j in whole]).exp().sum(-1, keepdim=True)
        )
    kept = _mask_min_p(_mask_sorted(values, params, vocab_size, total), params)
    # Without top-k the set is exact when the candidates alone hold top_p of the mass, so every
    # token past them would be dropped anyway.
    mass = (values.exp() / total).sum(-1).tolist()
    fallback = [j for j in whole if mass[j] < params[j].top_p]
    positions = _invert_cdf(kept, uniforms)
    return candidate_ids.gather(1, positions.unsqueeze(1)).squeeze(1), fallback


def _invert_cdf(logits: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Column index per row drawn in proportion to exp(logits), using one uniform in [0, 1) per row.

    Each row's best logit must be 0 (so exp cannot overflow) and finite.
    """
    cdf = logits.exp().double().cumsum(-1)  # [rows, n]; float64 keeps rare tokens distinguishable
    total = cdf[:, -1:]
    # Stay strictly below the total, so the search always lands on a token with positive mass.
    target = torch.minimum(
        uniforms.unsqueeze(1) * total, torch.nextafter(total, torch.zeros_like(total))
    )
    return torch.searchsorted(cdf, target, right=True).squeeze(1)


def _uniforms(generators: Sequence[torch.Generator | None], device: torch.device) -> torch.Tensor:
    """One uniform [0, 1) float64 per row: seeded rows from their own generator, the rest from the global RNG."""
    uniforms = torch.empty(len(generators), dtype=torch.float64)
    unseeded = [row for row, generator in enumerate(generators) if generator is None]
    if unseeded:
        uniforms[unseeded] = torch.rand(len(unseeded), dtype=torch.float64)
    for row, generator in enumerate(generators):
        if generator is not None:
            uniforms[row] = torch.rand(
                (), dtype=torch.float64, generator=generator, device=generator.device
            ).cpu()
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
    top_values, top_ids, chosen_id_list = top_values.tolist(), top_ids.tolist(), chosen_ids.tolist()
    for j, row in enumerate(rows):
        k = requests[row].params.logprobs or 0
        top = tuple(zip(top_ids[j][:k], top_values[j][:k]))
        result[row] = TokenLogprobs(chosen_id_list[j], chosen[j], top)
    return result
