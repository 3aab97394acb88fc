"""The instants of one request's life in the engine, shared by the engine that records them and the
metrics, traces and responses that report them. A leaf: it imports nothing from rebar."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class RequestTiming:
    """Where one request's time went, as `time.monotonic()` instants.

    queue: arrival in the engine -> first scheduled; prefill: first scheduled -> first token
    (chunked prefill and any wait between chunks included); decode: first token -> finished.
    A request that never ran (aborted while waiting) has no `scheduled`/`first_token`.
    """

    arrival: float
    scheduled: float | None
    first_token: float | None
    finished: float

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
        )
