"""How many draft tokens each sequence tries this step: as many as raise the step's throughput.

A step's time depends on how many tokens it computes (`StepCost`, measured on this machine at load).
On a CPU a one-token decode step is bound by reading the weights, and checking a few more tokens in
the same pass costs a fraction of a step; once the batch is large the step is bound by arithmetic
and every extra token costs about what it would as its own step. Each sequence's drafts hold with
a rate (`Acceptance`) learned from its own recent verdicts: with rate a, its j-th draft token adds
a^j expected tokens (it counts only if every draft before it held too).

`choose_draft_lengths` takes draft slots best-first and keeps the prefix with the most expected
tokens per second, so a sequence whose drafts rarely hold, or a batch already bound by arithmetic,
drafts nothing: a step never becomes slower per expected token than the step without drafts.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

# Each draft token checked weighs what came before this much less: about the last ten count.
DECAY = 0.9
# The drafter's overall rate stands in for this many of a sequence's own draft tokens, so a new
# sequence starts from what the drafter achieves and its own record takes over as it grows.
PRIOR_WEIGHT = 1.0
# A draft slot expected to add less than this many tokens is never worth its row.
MIN_GAIN = 0.01


@dataclass
class Acceptance:
    """Decayed counts of one sequence's draft tokens kept and refused.

    Each draft token checked is a trial: kept, or refused (a verdict refuses at most one, the first
    the model would not have produced; the ones after it are never judged). Every trial weighs the
    earlier ones `decay` less, so a long run of kept copies does not outweigh a change of regime
    for long.
    """

    kept: float = 0.0
    refused: float = 0.0
    decay: float = DECAY

    def update(self, num_drafted: int, num_accepted: int) -> None:
        for _ in range(num_accepted):
            self.kept, self.refused = self.kept * self.decay + 1, self.refused * self.decay
        if num_accepted < num_drafted:
            self.kept, self.refused = self.kept * self.decay, self.refused * self.decay + 1

    def rate(self, prior: float) -> float:
        """The chance that a draft token holds given the ones before it did: the share kept,
        shrunk toward `prior` while the sequence has few verdicts of its own."""
        total = self.kept + self.refused + PRIOR_WEIGHT
        return (self.kept + PRIOR_WEIGHT * prior) / total


class StepCost:
    """Seconds of a step computing `rows` tokens: the lower convex hull of measured points, linear
    between them and past the last one (along the last segment's slope).

    Interference on a shared machine only ever slows a measured step down, so a point above the
    hull of the others is noise: the hull is the truer curve, and it never falls with more rows.
    """

    def __init__(self, points: Sequence[tuple[int, float]]) -> None:
        if len(points) < 2:
            raise ValueError("a step-cost curve needs at least two measured points")
        hull: list[tuple[int, float]] = []
        for point in sorted(points):
            while hull and point[1] <= hull[-1][1]:  # a cheaper step with more rows: noise above
                hull.pop()
            while len(hull) >= 2 and _above(hull[-2], hull[-1], point):
                hull.pop()
            hull.append(point)
        if len(hull) == 1:  # every measured point costs the same or less with more rows
            hull.append((hull[0][0] + 1, hull[0][1]))
        self.rows = [r for r, _ in hull]
        self.seconds = [seconds for _, seconds in hull]

    def __call__(self, rows: int) -> float:
        index = bisect.bisect_left(self.rows, rows)
        if index < len(self.rows) and self.rows[index] == rows:
            return self.seconds[index]
        # Interpolate on the segment around `rows`, or extend the first or last one.
        right = min(max(index, 1), len(self.rows) - 1)
        r0, r1 = self.rows[right - 1], self.rows[right]
        s0, s1 = self.seconds[right - 1], self.seconds[right]
        return max(s0 + (s1 - s0) * (rows - r0) / (r1 - r0), 1e-9)


def _above(a: tuple[int, float], b: tuple[int, float], c: tuple[int, float]) -> bool:
    """Whether b lies on or above the segment from a to c."""
    return (b[1] - a[1]) * (c[0] - a[0]) >= (c[1] - a[1]) * (b[0] - a[0])


@dataclass(frozen=True)
class Candidate:
    """A sequence that may draft: its key, the rate its drafts hold, and the most it may draft."""

    key: Hashable
    rate: float
    max_tokens: int


def a_slot_may_pay(
    base_rows: int, base_tokens: int, cost: StepCost, seconds_per_draft: float = 0.0
) -> bool:
    """Whether even a draft token sure to hold (gain 1) would raise the step's tokens per second;
    when not, no draft can (see `choose_draft_lengths`), and the drafters need not be asked."""
    rows, tokens = max(base_rows, 1), max(base_tokens, 1)
    return _slot_pays(1.0, tokens / cost(rows), rows, cost, seconds_per_draft)


def _slot_pays(
    gain: float, rate: float, rows: int, cost: StepCost, seconds_per_draft: float
) -> bool:
    """Whether a slot expected to add `gain` tokens to a step of `rows` rows adds them at a higher
    rate than `rate` tokens per second (breaking even does not pay)."""
    return gain > rate * (cost(rows + 1) - cost(rows) + seconds_per_draft)


def choose_draft_lengths(
    candidates: Sequence[Candidate],
    base_rows: int,
    base_tokens: int,
    cost: StepCost,
    seconds_per_draft: float = 0.0,
) -> dict[Hashable, int]:
    """Draft tokens per candidate (absent: none) for a step that computes `base_rows` tokens and
    samples `base_tokens` without drafts; making each draft token costs `seconds_per_draft` more.

    Slots are taken best-first (the highest expected gain a^j among every candidate's next slot),
    and of every such prefix the one with the most expected tokens per second wins. The search
    ends at a slot that gains less than MIN_GAIN, or whose gain per second it adds is below the best
    rate so far: `cost` is convex (a lower hull) and gains only shrink, so no later slot could
    raise the rate again. A batch bound by arithmetic stops at its first slot.
    """
    # Max-heap of (gain of the candidate's next slot, order, candidate).
    heap = [(-c.rate, i, c) for i, c in enumerate(candidates) if c.max_tokens > 0 and c.rate > 0]
    heapq.heapify(heap)
    rows, tokens, drafting = base_rows, float(base_tokens), 0.0
    best_rate, best_count = tokens / cost(rows), 0
    taken: list[Hashable] = []  # the candidate of each slot, best-first
    lengths: dict[Hashable, int] = {}
    while heap:
        negative_gain, order, candidate = heapq.heappop(heap)
        gain = -negative_gain
        if gain < MIN_GAIN or not _slot_pays(gain, best_rate, rows, cost, seconds_per_draft):
            break
        rows, tokens, drafting = rows + 1, tokens + gain, drafting + seconds_per_draft
        taken.append(candidate.key)
        rate = tokens / (cost(rows) + drafting)
        if rate > best_rate:
            best_rate, best_count = rate, len(taken)
        length = lengths[candidate.key] = lengths.get(candidate.key, 0) + 1
        if length < candidate.max_tokens:
            heapq.heappush(heap, (-gain * candidate.rate, order, candidate))
    chosen: dict[Hashable, int] = {}
    for key in taken[:best_count]:
        chosen[key] = chosen.get(key, 0) + 1
    return chosen
