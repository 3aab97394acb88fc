"""One step's sampling: a token for every sequence that samples, and the verdict on its drafts.

A sequence with draft tokens has one row of logits per position: after its last token and after
each draft. Each row is sampled exactly as a step without drafts would sample that position (its
own token history, the drafts before it included; its grammar's mask after them; the next uniform
of its generator), and the drafts are kept while they equal what was sampled: the first row that
differs gives the sequence its own token instead, and when every draft holds the last row gives one
more. That is rejection sampling (Leviathan et al. 2023) for a draft that proposes one token with
certainty, and it needs no correction: the tokens kept are the very tokens decoding without drafts
would have drawn, so the output follows the same distribution, token for token under a seed.

A seeded sequence's generator is then moved back to where the kept tokens leave it: rows past the
verdict drew uniforms that decoding without drafts never draws.

A draft model sampling its drafts from its own distribution q (`draft_probabilities`) is checked by
rejection sampling proper: with p the model's distribution at a position, a draft d is kept with
probability min(1, p(d) / q(d)); the first one refused is replaced by a draw from the normalised
max(p - q, 0), and when all hold one more token is drawn from p. The output follows p exactly (the
paper's theorem; tests/engine/test_spec_distribution.py checks it), but the tokens differ from
decoding without drafts under the same seed.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rebar.engine.grammar import GrammarMatcher, StepMask, TokenMasks
from rebar.engine.sampler import (
    SampledToken,
    SampleRequest,
    distributions,
    is_plain_greedy,
    sample_batch,
    token_logprobs,
)
from rebar.engine.sampling_params import SamplingParams
from rebar.engine.token_draw import advance_generator
from rebar.kernels.best_logits import BestTokens

logger = logging.getLogger("rebar.engine")


@dataclass(frozen=True)
class SamplingRow:
    """What one sequence brings to the step's sampling."""

    params: SamplingParams
    generator: torch.Generator | None
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    matcher: GrammarMatcher | None
    draft_token_ids: tuple[int, ...] = ()
    # [len(draft_token_ids), vocab]: the distribution each draft was sampled from, when it was
    # sampled (None: drafts proposed with certainty).
    draft_probabilities: torch.Tensor | None = None


@dataclass(frozen=True)
class Verdict:
    """The tokens a sequence appends this step, in order: its kept drafts, then its own token.

    `failed`: a position could not be sampled (its logits hold NaN or nothing finite); the tokens
    before it still count, and the sequence must fail after them.
    """

    tokens: tuple[SampledToken, ...]
    num_accepted: int
    failed: bool = False


class StepSampler:
    """Samples a step's rows (`TokenMasks` fills the grammar masks) and judges the drafts."""

    def __init__(self, token_masks: TokenMasks) -> None:
        self.token_masks = token_masks

    def sample(
        self, sequences: Sequence[SamplingRow], logits: torch.Tensor | BestTokens
    ) -> list[Verdict]:
        """One verdict per sequence; `logits` has 1 + len(drafts) rows per sequence, in order (or,
        when every sequence's `best_token_suffices`, each of those rows' best token)."""
        if isinstance(logits, BestTokens):
            assert all(best_token_suffices(s) for s in sequences)
            return [
                judge(s.draft_token_ids, sampled)
                for s, sampled in zip(sequences, _rows_of(sequences, _best_sampled(logits)))
            ]
        starts = [0]
        for sequence in sequences:
            starts.append(starts[-1] + 1 + len(sequence.draft_token_ids))
        sampled = [i for i, s in enumerate(sequences) if s.draft_probabilities is not None]
        if not sampled:
            return self._sample_matching(sequences, logits)
        matching = [i for i in range(len(sequences)) if i not in set(sampled)]
        verdicts: dict[int, Verdict] = {}
        if matching:
            rows = torch.cat([logits[starts[i] : starts[i + 1]] for i in matching])
            verdicts |= zip(matching, self._sample_matching([sequences[i] for i in matching], rows))
        for i in sampled:
            verdicts[i] = judge_by_rejection(sequences[i], logits[starts[i] : starts[i + 1]])
        return [verdicts[i] for i in range(len(sequences))]

    def _sample_matching(
        self, sequences: Sequence[SamplingRow], logits: torch.Tensor
    ) -> list[Verdict]:
        """Verdicts on drafts proposed with certainty (and plain sampling where there are none)."""
        rows = [row for sequence in sequences for row in _position_rows(sequence)]
        mask = self._masks(sequences)
        # Seeded sequences with drafts: where their generators stand before any row draws.
        saved = {
            i: s.generator.get_state()
            for i, s in enumerate(sequences)
            if s.draft_token_ids and s.generator is not None and not s.params.greedy
        }
        sampled = _rows_of(sequences, _sample_isolated(logits, rows, mask))
        verdicts: list[Verdict] = []
        for i, (sequence, positions) in enumerate(zip(sequences, sampled)):
            verdict = judge(sequence.draft_token_ids, positions)
            if i in saved and len(verdict.tokens) < len(positions):
                generator = sequence.generator
                assert generator is not None
                generator.set_state(saved[i])
                advance_generator(generator, len(verdict.tokens))
            verdicts.append(verdict)
        return verdicts

    def _masks(self, sequences: Sequence[SamplingRow]) -> StepMask | None:
        constrained: list[tuple[int, GrammarMatcher, tuple[int, ...]]] = []
        row = 0
        for sequence in sequences:
            if sequence.matcher is not None:
                constrained.append((row, sequence.matcher, sequence.draft_token_ids))
            row += 1 + len(sequence.draft_token_ids)
        return self.token_masks.fill_with_drafts(constrained) if constrained else None


def best_token_suffices(sequence: SamplingRow) -> bool:
    """Whether every position of `sequence` takes the best token of the model's raw logits and
    reports nothing else from them (plain greedy, no log-probabilities, no grammar, drafts proposed
    with certainty): its step may then compute each row's best token alone."""
    params = sequence.params
    return (
        is_plain_greedy(params)
        and params.logprobs is None
        and sequence.matcher is None
        and sequence.draft_probabilities is None
    )


def _best_sampled(best: BestTokens) -> list[SampledToken | None]:
    """`sample_batch`'s result for plain greedy rows whose best tokens are known."""
    return [
        SampledToken(t, None) if ok else None
        for t, ok in zip(best.token_ids.tolist(), best.valid.tolist())
    ]


def _rows_of(
    sequences: Sequence[SamplingRow], sampled: list[SampledToken | None]
) -> list[list[SampledToken | None]]:
    """`sampled` (1 + len(drafts) per sequence, in order) split by sequence."""
    split, start = [], 0
    for sequence in sequences:
        end = start + 1 + len(sequence.draft_token_ids)
        split.append(sampled[start:end])
        start = end
    return split


def judge(draft_token_ids: tuple[int, ...], sampled: Sequence[SampledToken | None]) -> Verdict:
    """Keep the drafts while each equals the token sampled at its position; the first sampled token
    that differs (or the one after the last draft) is the sequence's own next token."""
    tokens: list[SampledToken] = []
    for position, token in enumerate(sampled):
        if token is None:
            return Verdict(tuple(tokens), len(tokens), failed=True)
        tokens.append(token)
        if position == len(draft_token_ids) or token.token_id != draft_token_ids[position]:
            return Verdict(tuple(tokens), position)
    raise AssertionError("one sampled row per draft and one after them")


def judge_by_rejection(sequence: SamplingRow, logits: torch.Tensor) -> Verdict:
    """Rejection sampling of drafts drawn from `sequence.draft_probabilities` (see the module
    docstring); `logits` holds the sequence's 1 + len(drafts) rows."""
    drafts, generator = sequence.draft_token_ids, sequence.generator
    assert sequence.draft_probabilities is not None and sequence.matcher is None
    rows = _position_rows(sequence)
    target = distributions(logits, rows)  # [1 + len(drafts), vocab]
    draft = sequence.draft_probabilities.to(target.dtype)
    chosen: list[int] = []
    for position, token in enumerate(drafts):
        if not target[position].sum() > 0:
            return _verdict(logits, rows, chosen, len(chosen), failed=True)
        if _uniform(generator) * draft[position, token] < target[position, token]:
            chosen.append(token)
            continue
        residual = (target[position] - draft[position]).clamp_(min=0.0)
        if not residual.sum() > 0:  # p equals q: a refusal had probability 0
            residual = target[position]
        chosen.append(_draw(residual, generator))
        return _verdict(logits, rows, chosen, position)
    if not target[-1].sum() > 0:
        return _verdict(logits, rows, chosen, len(chosen), failed=True)
    chosen.append(_draw(target[-1], generator))
    return _verdict(logits, rows, chosen, len(drafts))


def _verdict(
    logits: torch.Tensor,
    rows: list[SampleRequest],
    token_ids: list[int],
    num_accepted: int,
    failed: bool = False,
) -> Verdict:
    count = len(token_ids)
    logprobs = token_logprobs(logits[:count], torch.tensor(token_ids), rows[:count])
    tokens = tuple(SampledToken(t, lp) for t, lp in zip(token_ids, logprobs))
    return Verdict(tokens, num_accepted, failed)


def _uniform(generator: torch.Generator | None) -> float:
    if generator is None:
        return float(torch.rand((), dtype=torch.float64))
    return float(torch.rand((), dtype=torch.float64, generator=generator))


def _draw(weights: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(weights, 1, generator=generator))


def _position_rows(sequence: SamplingRow) -> list[SampleRequest]:
    """One sampling row per position; penalties see the drafts before each position as output."""
    params, generator = sequence.params, sequence.generator
    if not params.has_penalties:  # histories are only read by penalties: do not copy them
        return [SampleRequest(params, generator, (), ())] * (1 + len(sequence.draft_token_ids))
    outputs = list(sequence.output_token_ids)
    rows = []
    for position in range(1 + len(sequence.draft_token_ids)):
        history = outputs + list(sequence.draft_token_ids[:position])
        rows.append(SampleRequest(params, generator, sequence.prompt_token_ids, history))
    return rows


def _sample_isolated(
    logits: torch.Tensor, rows: list[SampleRequest], mask: StepMask | None
) -> list[SampledToken | None]:
    """`sample_batch`, and when the batch fails, each row alone, so only a row that cannot be
    sampled by itself gets None."""
    try:
        return sample_batch(logits, rows, mask)
    except Exception:
        logger.exception("batched sampling failed; sampling rows one at a time")
    sampled: list[SampledToken | None] = []
    for i, row in enumerate(rows):
        try:
            sampled.append(sample_batch(logits[i : i + 1], [row], mask and mask.for_row(i))[0])
        except Exception:
            logger.exception("sampling one row failed")
            sampled.append(None)
    return sampled
