"""Property-based: random add / step / abort / finish sequences, with and without prompt chunks
beside the steps landing (or failing) at random times, keep the scheduler and pool consistent,
every request eventually finishes, and every block returns to the pool."""

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
        st.tuples(st.just("land"), st.booleans()),
    ),
    min_size=10,
    max_size=120,
)


def land(scheduler: Scheduler, failed: bool = False) -> None:
    """The chunk beside the steps, if any, is done (or raised: its request fails, as the engine
    core fails it)."""
    if scheduler.in_flight is None:
        return
    event("a chunk beside the steps")
    request = scheduler.land(failed)
    if failed and request is not None:
        scheduler.finish_request(request.request_id, RequestStatus.FINISHED_ERROR, False)


def advance(scheduler: Scheduler, token: int, background: bool = False) -> None:
    """One engine step without a model: compute what was planned, sample `token`, stop at
    max_total_tokens."""
    plan = scheduler.schedule(background=background)
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
    prompt_cap=st.one_of(st.none(), st.integers(1, 4), st.integers(1, 40)),
    prefix=st.booleans(),
    background=st.booleans(),
)
def test_random_traffic_keeps_invariants_and_returns_every_block(
    actions, num_blocks, max_num_seqs, budget, prompt_cap, prefix, background
) -> None:
    scheduler = Scheduler(
        SchedulerConfig(max_num_seqs, budget, prompt_cap),
        KVCacheManager(num_blocks, BLOCK, prefix),
    )
    added: list[str] = []
    run_actions(scheduler, actions, added, num_blocks, background)
    drain(scheduler, num_blocks, added, background)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    actions=actions,
    num_blocks=st.integers(16, 40),
    max_num_seqs=st.integers(2, 6),
    budget=st.integers(8, 40),
    prompt_cap=st.integers(1, 4),
)
def test_random_traffic_beside_a_decoding_stream_keeps_invariants(
    actions, num_blocks, max_num_seqs, budget, prompt_cap
) -> None:
    """As above, with a stream decoding from the start and a small prompt cap, so that most
    prompts go beside the steps."""
    scheduler = Scheduler(
        SchedulerConfig(max_num_seqs, budget, prompt_cap), KVCacheManager(num_blocks, BLOCK, True)
    )
    scheduler.add_request(Request("stream", [5], SamplingParams(max_tokens=40), 41))
    advance(scheduler, 0, True)
    added = ["stream"]
    run_actions(scheduler, actions, added, num_blocks, True)
    drain(scheduler, num_blocks, added, True)


def run_actions(scheduler, actions, added: list[str], num_blocks: int, background: bool) -> None:
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
            advance(scheduler, action[1], background)
        elif kind == "land":
            land(scheduler, failed=action[1])
        elif added:
            status = (
                RequestStatus.FINISHED_ABORTED
                if kind == "abort"
                else RequestStatus.FINISHED_STOPPED
            )
            scheduler.finish_request(added[action[1] % len(added)], status)
        scheduler.check_integrity()


def drain(scheduler, num_blocks: int, added: list[str], background: bool) -> None:
    """Every request must finish (no starvation, no livelock) within a generous bound, and every
    block return to the pool."""
    for _ in range(2000):
        if not scheduler.num_unfinished:
            break
        land(scheduler)
        advance(scheduler, 0, background)
        scheduler.check_integrity()
    land(scheduler)  # a finished request's chunk may still be in flight
    assert scheduler.num_unfinished == 0
    event(f"preemptions: {'some' if scheduler.num_preemptions else 'none'}")
    event(f"prefix hits: {'some' if scheduler.kv.pool.num_prefix_hits else 'none'}")
    assert scheduler.kv.pool.num_free_blocks == num_blocks
    assert all(not scheduler.kv.block_ids(request_id) for request_id in added)


class KVContents:
    """What each cache slot holds (the token whose K/V was written there), to check that every
    block the prefix cache publishes holds exactly the tokens it is published for."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.slots: dict[int, int] = {}

    def write(self, item) -> None:
        tokens = item.token_ids + item.draft_token_ids
        for offset, token in enumerate(tokens):
            position = item.start_position + offset
            block = item.block_ids[position // self.block_size]
            self.slots[block * self.block_size + position % self.block_size] = token

    def check_cached_blocks(self, pool) -> None:
        for block in pool.blocks:
            if block.block_hash is None:
                continue
            held = [self.slots.get(block.block_id * self.block_size + i) for i in range(BLOCK)]
            assert held == list(block.token_ids), f"cached block {block.block_id} holds {held}"


def advance_with_drafts(
    scheduler: Scheduler, contents: KVContents, rng, background: bool = False
) -> None:
    """A step where every decoding request asks for draft slots; a random prefix of each one's
    drafts is kept, then one more token, as the verdict on real drafts would. A chunk beside the
    steps lands now and then, its K/V written only then."""
    from dataclasses import replace

    if scheduler.in_flight is not None and rng.random() < 0.5:
        contents.write(scheduler.in_flight)
        land(scheduler)
    lookahead = {r.request_id: rng.randrange(0, 6) for r in scheduler.running}
    plan = scheduler.schedule(lookahead, background)
    items = [
        replace(
            item,
            draft_token_ids=tuple(
                rng.randrange(VOCAB) for _ in range(rng.randrange(item.num_lookahead + 1))
            ),
        )
        if item.num_lookahead
        else item
        for item in plan.scheduled
    ]
    for item in items:
        contents.write(item)
    scheduler.update_after_step(plan)
    for item in items:
        request = scheduler.requests[item.request_id]
        if not item.sample:
            continue
        kept = rng.randrange(len(item.draft_token_ids) + 1)
        appended = [*item.draft_token_ids[:kept], rng.randrange(VOCAB)]
        finished = False
        for token in appended:
            request.append_output(token)
            if request.num_tokens >= request.max_total_tokens:
                scheduler.finish_request(item.request_id, RequestStatus.FINISHED_LENGTH)
                finished = True
                break
        if item.num_lookahead and not finished:
            scheduler.commit_drafts(item.request_id, kept)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    prompts_and_lengths=st.lists(st.tuples(prompts, st.integers(1, 24)), min_size=1, max_size=8),
    num_blocks=st.integers(8, 16),
    max_num_seqs=st.integers(1, 6),
    budget=st.integers(1, 40),
    prompt_cap=st.one_of(st.none(), st.integers(1, 4), st.integers(1, 40)),
    seed=st.integers(0, 2**16),
    background=st.booleans(),
)
def test_draft_slots_leave_exact_accounting_and_an_honest_prefix_cache(
    prompts_and_lengths, num_blocks, max_num_seqs, budget, prompt_cap, seed, background
) -> None:
    """Requests decode with draft slots and random verdicts (with preemptions when the pool runs
    dry): between steps each running request holds exactly the blocks of its computed tokens
    (check_integrity), every published block holds exactly its tokens' K/V, and at the end every
    block is back in the pool."""
    import random

    rng = random.Random(seed)
    scheduler = Scheduler(
        SchedulerConfig(max_num_seqs, budget, prompt_cap), KVCacheManager(num_blocks, BLOCK, True)
    )
    contents = KVContents(BLOCK)
    for index, (prompt, max_new) in enumerate(prompts_and_lengths):
        max_new = min(max_new, num_blocks * BLOCK - len(prompt))
        params = SamplingParams(max_tokens=max_new)
        scheduler.add_request(Request(f"r{index}", prompt, params, len(prompt) + max_new))
    for _ in range(2000):
        if not scheduler.num_unfinished:
            break
        advance_with_drafts(scheduler, contents, rng, background)
        scheduler.check_integrity()
        contents.check_cached_blocks(scheduler.kv.pool)
    land(scheduler)
    assert scheduler.num_unfinished == 0
    assert scheduler.kv.pool.num_free_blocks == num_blocks
