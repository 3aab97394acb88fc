"""Property-based: random add / step / abort / finish sequences keep the scheduler and pool
consistent, every request eventually finishes, and every block returns to the pool."""

from __future__ import annotations

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from rebar import SamplingParams
from rebar.engine.kv_cache_manager import KVCacheManager
from rebar.engine.request import Request, RequestStatus
from rebar.engine.scheduler import Scheduler, SchedulerConfig

BLOCK = 4
VOCAB = 6  # a tiny vocabulary makes shared prefixes (and prefix-cache hits) common

# Prompts start with one of a few shared prefixes so prefix-cache hits are common.
SHARED_PREFIXES = [[], [1, 2, 3, 4, 5, 0, 1, 2], [3] * 12]
prompts = st.builds(
    lambda prefix, tail: prefix + tail,
    st.sampled_from(SHARED_PREFIXES),
    st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=16),
)
actions = st.lists(
    st.one_of(
        st.tuples(st.just("add"), prompts, st.integers(1, 24)),
        st.tuples(st.just("step"), st.integers(0, VOCAB - 1)),
        st.tuples(st.just("step"), st.integers(0, VOCAB - 1)),
        st.tuples(st.just("abort"), st.integers(0, 50)),
        st.tuples(st.just("finish"), st.integers(0, 50)),
    ),
    min_size=10,
    max_size=120,
)


def advance(scheduler: Scheduler, token: int) -> None:
    """One engine step without a model: compute what was planned, sample `token`, stop at
    max_total_tokens."""
    plan = scheduler.schedule()
    scheduler.update_after_step(plan)
    for item in plan.scheduled:
        request = scheduler.requests[item.request_id]
        assert request.num_computed_tokens <= request.num_tokens
        if item.sample:
            request.append_output(token)
            if request.num_tokens >= request.max_total_tokens:
                scheduler.finish_request(item.request_id, RequestStatus.FINISHED_LENGTH)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    actions=actions,
    num_blocks=st.integers(8, 16),
    max_num_seqs=st.integers(1, 6),
    budget=st.integers(1, 40),
    prefix=st.booleans(),
)
def test_random_traffic_keeps_invariants_and_returns_every_block(
    actions, num_blocks, max_num_seqs, budget, prefix
) -> None:
    scheduler = Scheduler(
        SchedulerConfig(max_num_seqs, budget), KVCacheManager(num_blocks, BLOCK, prefix)
    )
    added: list[str] = []
    for action in actions:
        kind = action[0]
        if kind == "add":
            prompt, max_new = action[1], action[2]
            # Admission guarantees one request fits the pool on its own.
            max_new = min(max_new, num_blocks * BLOCK - len(prompt))
            request_id = f"r{len(added)}"
            scheduler.add_request(
                Request(
                    request_id, prompt, SamplingParams(max_tokens=max_new), len(prompt) + max_new
                )
            )
            added.append(request_id)
        elif kind == "step":
            advance(scheduler, action[1])
        elif added:
            status = (
                RequestStatus.FINISHED_ABORTED
                if kind == "abort"
                else RequestStatus.FINISHED_STOPPED
            )
            scheduler.finish_request(added[action[1] % len(added)], status)
        scheduler.check_integrity()

    # Drain: every request must finish (no starvation, no livelock) within a generous bound.
    for _ in range(2000):
        if not scheduler.num_unfinished:
            break
        advance(scheduler, 0)
        scheduler.check_integrity()
    assert scheduler.num_unfinished == 0
    event(f"preemptions: {'some' if scheduler.num_preemptions else 'none'}")
    event(f"prefix hits: {'some' if scheduler.kv.pool.num_prefix_hits else 'none'}")
    assert scheduler.kv.pool.num_free_blocks == num_blocks
    assert all(not scheduler.kv.block_ids(request_id) for request_id in added)
