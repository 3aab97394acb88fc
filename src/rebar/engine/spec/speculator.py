"""The engine core's side of speculative decoding: which sequences draft how many tokens this step,
the drafts themselves, and the record of what held.

Per step: `lookahead` asks the drafter what each decoding sequence could draft, and the policy
(`choose_draft_lengths`) how many of those are worth checking; the scheduler grants slots for them
where budget and free blocks allow; `attach_drafts` fills the granted slots; the model computes
every draft token; the step's sampler keeps those it would have produced itself (`step_sampling`);
`record` learns from the verdict.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch

from rebar.engine.grammar import GrammarMatcher
from rebar.engine.request import Request
from rebar.engine.scheduler import ScheduledRequest
from rebar.engine.spec.policy import (
    Acceptance,
    Candidate,
    StepCost,
    a_slot_may_pay,
    choose_draft_lengths,
)

# What the drafter-wide rate starts from, before any verdict (a weak guess, soon outweighed).
INITIAL_RATE = 0.5
# The drafter-wide rate forgets more slowly than a sequence's own (many sequences feed it).
OVERALL_DECAY = 0.995
# A sequence that could draft but has not been checked for this many steps (its rate, or its
# drafter's, said drafts would not pay) is offered one draft token at INITIAL_RATE, priced like
# any other: where a step is bound by memory the probe costs little, and it lets a sequence whose
# text turned predictable (an answer's preamble over, a copy begun) be noticed again.
PROBE_INTERVAL = 16
# Each refused probe doubles the sequence's wait before the next, up to this many steps; a kept
# draft brings it back to PROBE_INTERVAL. A text that never repeats (or a draft model that never
# agrees) then costs a probe's catch-up once in a long while, not every PROBE_INTERVAL steps.
MAX_PROBE_INTERVAL = 256


@dataclass
class SequenceSpeculation:
    """One sequence's speculation: its records, and what its drafter keeps for it."""

    # Kept and refused draft tokens by cue: what the drafter said a proposal rests on (the n-gram
    # drafter tells a copy in progress from a short match; others give none, ""), as the two hold
    # at very different rates.
    acceptance: dict[str, Acceptance] = field(default_factory=dict)
    drafter_state: object = None  # the drafter's own (an n-gram index, a draft model's progress)
    planned: tuple[int, ...] = ()  # tokens proposed when the step was planned (drafters that can)
    cue: str = ""  # what this step's proposal rests on, set by the drafter with `planned`
    # This step's drafts' distributions [drafts, vocab], when they were sampled (a draft model
    # drafting for a sampled request); None: proposed with certainty.
    draft_probabilities: torch.Tensor | None = None
    num_drafted: int = 0  # over the sequence's life
    num_accepted: int = 0
    steps_unchecked: int = 0  # steps it could have drafted since its drafts were last checked
    probe_interval: int = PROBE_INTERVAL  # steps unchecked before it is probed
    probing: bool = False  # this step's drafts are a probe


@dataclass(frozen=True)
class Drafting:
    """A sequence asked to draft: its request, its speculation, and its grammar if it has one."""

    request: Request
    speculation: SequenceSpeculation
    matcher: GrammarMatcher | None


class Drafter(Protocol):
    """Proposes draft tokens. `name` labels its figures (metrics, docs)."""

    name: str

    def outlook(self, sequence: Drafting, max_tokens: int) -> int:
        """How many tokens it could draft for `sequence` now, at most `max_tokens`; a drafter that
        knows its tokens already leaves them in `sequence.speculation.planned`."""
        ...

    def draft(self, batch: Sequence[tuple[Drafting, ScheduledRequest]]) -> list[tuple[int, ...]]:
        """Draft tokens for each scheduled item, at most its `num_lookahead` each; its blocks hold
        room for them."""
        ...


@dataclass
class DraftCounts:
    """Draft tokens checked and kept, and steps that checked any, over the engine's life."""

    num_drafted: int = 0
    num_accepted: int = 0
    num_steps: int = 0  # sequence-steps that checked drafts


class Speculator:
    """Plans, fills and learns from one drafter's drafts for an engine core."""

    def __init__(
        self,
        drafter: Drafter,
        cost: StepCost,
        max_draft_tokens: int,
        seconds_per_draft: float = 0.0,
    ) -> None:
        """`cost` prices the engine's steps; `seconds_per_draft` what drafting one more token
        costs besides (a draft model's step; nothing for n-gram lookups)."""
        self.drafter = drafter
        self.cost = cost
        self.max_draft_tokens = max_draft_tokens
        self.seconds_per_draft = seconds_per_draft
        self.overall: dict[str, Acceptance] = {}  # every sequence's verdicts, by cue
        self.counts = DraftCounts()

    def lookahead(
        self, sequences: Sequence[Drafting], base_rows: int, base_tokens: int
    ) -> dict[str, int]:
        """Draft slots to ask the scheduler for, by request id, for a step that computes
        `base_rows` tokens and samples `base_tokens` without drafts."""
        for sequence in sequences:
            sequence.speculation.planned = ()
            sequence.speculation.cue = ""
            sequence.speculation.draft_probabilities = None
        if not a_slot_may_pay(base_rows, base_tokens, self.cost, self.seconds_per_draft):
            return {}  # a batch bound by arithmetic: not worth a lookup
        candidates = []
        for sequence in sequences:
            speculation, request = sequence.speculation, sequence.request
            if not self._may_draft(request):
                continue
            room = min(self.max_draft_tokens, request.max_total_tokens - request.num_tokens - 1)
            most = self.drafter.outlook(sequence, room) if room > 0 else 0
            if most > 0 and sequence.matcher is not None and speculation.planned:
                most = self._within_grammar(sequence, most)
            if most <= 0:
                continue
            speculation.steps_unchecked += 1
            rate = self._record(speculation).rate(self.overall_rate(speculation.cue))
            speculation.probing = (
                speculation.steps_unchecked > speculation.probe_interval and rate < INITIAL_RATE
            )
            if speculation.probing:
                candidates.append(Candidate(request.request_id, INITIAL_RATE, 1))
            else:
                candidates.append(Candidate(request.request_id, rate, most))
        if not candidates:
            return {}
        lengths = choose_draft_lengths(
            candidates, max(base_rows, 1), max(base_tokens, 1), self.cost, self.seconds_per_draft
        )
        return {str(key): length for key, length in lengths.items()}

    @staticmethod
    def _may_draft(request: Request) -> bool:
        return request.params.speculative and request.num_computed_tokens + 1 == request.num_tokens

    @staticmethod
    def _within_grammar(sequence: Drafting, most: int) -> int:
        """Planned drafts cut before the first one the grammar forbids (or after which it ends)."""
        speculation, matcher = sequence.speculation, sequence.matcher
        assert matcher is not None
        speculation.planned = speculation.planned[: matcher.valid_drafts(speculation.planned)]
        return min(most, len(speculation.planned))

    def overall_rate(self, cue: str = "") -> float:
        """The rate of every sequence's drafts on `cue`: a new sequence's prior."""
        overall = self.overall.get(cue)
        return overall.rate(INITIAL_RATE) if overall else INITIAL_RATE

    @staticmethod
    def _record(speculation: SequenceSpeculation) -> Acceptance:
        return speculation.acceptance.setdefault(speculation.cue, Acceptance())

    def attach_drafts(
        self, items: Sequence[ScheduledRequest], sequences: Mapping[str, Drafting]
    ) -> list[ScheduledRequest]:
        """`items` with their granted slots filled by the drafter (where it has tokens)."""
        asked = [(sequences[item.request_id], item) for item in items if item.num_lookahead > 0]
        if not asked:
            return list(items)
        drafts = dict(zip((item.request_id for _, item in asked), self.drafter.draft(asked)))
        filled = []
        for item in items:
            tokens = drafts.get(item.request_id, ())
            sequence = sequences.get(item.request_id)
            if tokens and sequence is not None and sequence.matcher is not None:
                tokens = tokens[: sequence.matcher.valid_drafts(tokens)]
            filled.append(replace(item, draft_token_ids=tokens) if tokens else item)
        return filled

    def record(self, speculation: SequenceSpeculation, num_drafted: int, num_accepted: int) -> None:
        """Learn from one verdict on `num_drafted` draft tokens."""
        if num_drafted == 0:
            return
        speculation.steps_unchecked = 0
        if num_accepted:
            speculation.probe_interval = PROBE_INTERVAL
        elif speculation.probing:
            speculation.probe_interval = min(2 * speculation.probe_interval, MAX_PROBE_INTERVAL)
        speculation.probing = False
        self._record(speculation).update(num_drafted, num_accepted)
        overall = self.overall.setdefault(speculation.cue, Acceptance(decay=OVERALL_DECAY))
        overall.update(num_drafted, num_accepted)
        speculation.num_drafted += num_drafted
        speculation.num_accepted += num_accepted
        self.counts.num_drafted += num_drafted
        self.counts.num_accepted += num_accepted
        self.counts.num_steps += 1
