"""What an engine reports about itself: its queues, KV cache, steps and drafts."""

from __future__ import annotations

from dataclasses import dataclass, field

from rebar.engine.spec.speculator import DraftCounts
from rebar.timing import DurationHistogram


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_blocks: int
    kv_usage: float
    num_prefix_queries: int
    num_prefix_hits: int
    num_preemptions: int
    num_requests_added: int  # every accepted request (an n > 1 request counts once)
    # Durations of whole steps (schedule, model, sampling, outputs) by kind: "decode" when every
    # scheduled request computed one token, else "prefill" (prompt tokens in the step).
    step_seconds: dict[str, DurationHistogram] = field(default_factory=dict)
    # Per step with grammar-constrained rows: filling and applying their token masks.
    grammar_mask_seconds: DurationHistogram | None = None
    # Speculative decoding, by drafter name: draft tokens checked and kept.
    drafts: dict[str, DraftCounts] = field(default_factory=dict)
