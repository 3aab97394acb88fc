"""The instants of one request's life in the engine, and the engine's step durations, shared by the
engine that records them and the metrics, traces and responses that report them. A leaf: it imports
nothing from rebar."""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class RequestTiming:
    """Where one request's time went, as `time.monotonic()` instants.

    queue: arrival in the engine -> first scheduled; prefill: first scheduled -> first token
    (chunked prefill and any wait between chunks included); decode: first token -> finished.
    A request that never ran (aborted while waiting) has no `scheduled`/`first_token`.
    `num_draft_tokens` / `num_accepted_tokens`: the speculative decoding behind the decode time,
    draft tokens checked and kept.
    """

    arrival: float
    scheduled: float | None
    first_token: float | None
    finished: float
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def queue_s(self) -> float:
        return (self.scheduled if self.scheduled is not None else self.finished) - self.arrival

    @property
    def prefill_s(self) -> float:
        if self.scheduled is None:
            return 0.0
        return (
            self.first_token if self.first_token is not None else self.finished
        ) - self.scheduled

    @property
    def decode_s(self) -> float:
        return 0.0 if self.first_token is None else self.finished - self.first_token

    @classmethod
    def combine(cls, timings: Iterable[RequestTiming]) -> RequestTiming | None:
        """The span of several choices of one request: earliest start of each phase, latest
        finish."""
        timings = list(timings)
        if not timings:
            return None

        def earliest(values):
            present = [v for v in values if v is not None]
            return min(present) if present else None

        return cls(
            min(t.arrival for t in timings),
            earliest(t.scheduled for t in timings),
            earliest(t.first_token for t in timings),
            max(t.finished for t in timings),
            sum(t.num_draft_tokens for t in timings),
            sum(t.num_accepted_tokens for t in timings),
        )


# Step-time buckets (seconds): 0.5 ms to ~10 s, 10% apart, so a p50 read from them is within ~5%
# of the true one. Durations above the last fall in +Inf.
STEP_BUCKETS: tuple[float, ...] = tuple(round(0.0005 * 1.1**i, 7) for i in range(105))
# Finer work inside a step (a grammar's token masks): 10 us to ~0.5 s, 10% apart.
FINE_BUCKETS: tuple[float, ...] = tuple(round(0.00001 * 1.1**i, 9) for i in range(114))


@dataclass
class DurationHistogram:
    """How many durations fell in each bucket of `bounds` (`STEP_BUCKETS` unless given; one more
    slot for +Inf), their sum and their count. Picklable: an engine process sends it with its
    counters."""

    counts: list[int]
    total_s: float = 0.0
    num: int = 0
    bounds: tuple[float, ...] = STEP_BUCKETS

    @classmethod
    def empty(cls, bounds: tuple[float, ...] = STEP_BUCKETS) -> DurationHistogram:
        return cls([0] * (len(bounds) + 1), bounds=bounds)

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, seconds)] += 1
        self.total_s += seconds
        self.num += 1

    def cumulative(self) -> list[tuple[str, int]]:
        """Prometheus' buckets: (upper bound, durations at or under it), +Inf last."""
        bounds = [repr(b) for b in self.bounds] + ["+Inf"]
        return list(zip(bounds, itertools.accumulate(self.counts), strict=True))

    def copy(self) -> DurationHistogram:
        return DurationHistogram(list(self.counts), self.total_s, self.num, self.bounds)
