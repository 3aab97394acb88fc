"""The scheduler's chunks beside the steps (`prefill_beside_decode`), with hand-built requests and
no model: which prompt goes, how much of it, what the steps do meanwhile, and how a chunk in flight
is kept from preemption, the prefix cache and the free list until it lands."""

from __future__ import annotations

from rebar import SamplingParams
from rebar.engine.kv_cache_manager import KVCacheManager
from rebar.engine.request import Request, RequestStatus
from rebar.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput

BLOCK = 4
CAP = 8  # max_prefill_tokens_while_decoding
STEP = 64  # max_num_batched_tokens


def make_scheduler(num_blocks: int = 64) -> Scheduler:
    return Scheduler(SchedulerConfig(8, STEP, CAP), KVCacheManager(num_blocks, BLOCK, True))


def make_request(request_id: str, num_prompt: int, first_token: int = 0) -> Request:
    prompt = list(range(first_token, first_token + num_prompt))
    return Request(request_id, prompt, SamplingParams(max_tokens=50), num_prompt + 50)


def step(scheduler: Scheduler, background: bool | None = None) -> SchedulerOutput:
    """Schedule, then what the engine does after its model pass (the chunk beside not included).
    `background` unless given: as the engine asks, whether no chunk is in flight."""
    if background is None:
        background = scheduler.in_flight is None
    plan = scheduler.schedule(background=background)
    scheduler.update_after_step(plan)
    for item in plan.scheduled:
        if item.sample:
            scheduler.requests[item.request_id].append_output(7)
    scheduler.check_integrity()
    return plan


def decoding_stream(scheduler: Scheduler) -> None:
    scheduler.add_request(make_request("stream", 4, first_token=1000))
    first = step(scheduler)
    assert first.background is None  # nothing decodes yet: a prompt alone runs in the step


def test_a_long_prompt_beside_a_stream_goes_in_chunks_of_a_step_budget_but_its_last_token() -> None:
    scheduler = make_scheduler()
    decoding_stream(scheduler)
    scheduler.add_request(make_request("long", 100))

    plan = step(scheduler)
    assert [item.request_id for item in plan.scheduled] == ["stream"]
    chunk = plan.background
    assert chunk is not None and scheduler.in_flight == chunk
    assert (chunk.request_id, chunk.start_position, len(chunk.token_ids)) == ("long", 0, STEP)
    assert chunk.prompt and not chunk.sample
    assert chunk.token_ids == tuple(range(STEP))

    for _ in range(3):  # until it lands, the steps decode the stream alone and start nothing
        plan = step(scheduler)
        assert [i.request_id for i in plan.scheduled] == ["stream"] and plan.background is None
    long = scheduler.land()
    assert long is scheduler.requests["long"] and long.num_computed_tokens == STEP
    scheduler.check_integrity()

    second = step(scheduler).background
    assert second is not None
    assert (second.start_position, len(second.token_ids)) == (STEP, 100 - STEP - 1)
    scheduler.land()
    last = step(scheduler)  # the last prompt token runs in a step, which samples after it
    assert [
        (i.request_id, i.start_position, len(i.token_ids), i.sample, i.prompt)
        for i in last.scheduled
    ] == [("stream", 9, 1, True, False), ("long", 99, 1, True, True)]


def test_without_background_or_for_a_short_prompt_the_step_takes_it_capped() -> None:
    scheduler = make_scheduler()
    decoding_stream(scheduler)
    scheduler.add_request(make_request("long", 100))
    plan = step(scheduler, background=False)
    assert plan.background is None and scheduler.in_flight is None
    assert [len(i.token_ids) for i in plan.scheduled] == [1, CAP]

    short = make_scheduler()
    decoding_stream(short)
    short.add_request(make_request("short", CAP + 1))  # the cap covers all but its last token
    plan = step(short)
    assert plan.background is None and [len(i.token_ids) for i in plan.scheduled] == [1, CAP]


def test_prompts_outnumbering_the_streams_run_in_the_steps_at_full_budget() -> None:
    scheduler = make_scheduler()
    decoding_stream(scheduler)
    scheduler.add_request(make_request("a", 30))
    scheduler.add_request(make_request("b", 30, first_token=500))
    plan = step(scheduler)
    assert plan.background is None
    assert [len(i.token_ids) for i in plan.scheduled] == [1, 30, 30]


def test_a_chunk_in_flight_is_published_in_the_prefix_cache_only_when_it_lands() -> None:
    scheduler = make_scheduler()
    decoding_stream(scheduler)
    scheduler.add_request(make_request("long", 100))
    step(scheduler)
    twin = make_request("twin", 100)
    assert scheduler.kv.find_cached_prefix(twin) == []  # its blocks are still being written
    scheduler.land()
    assert len(scheduler.kv.find_cached_prefix(twin)) == STEP // BLOCK


def test_a_failed_chunk_publishes_nothing_and_leaves_its_request_to_the_caller() -> None:
    scheduler = make_scheduler()
    decoding_stream(scheduler)
    scheduler.add_request(make_request("long", 100))
    step(scheduler)
    long = scheduler.land(failed=True)
    assert long is not None and long.num_computed_tokens == 0
    assert scheduler.kv.find_cached_prefix(make_request("twin", 100)) == []
    scheduler.finish_request("long", RequestStatus.FINISHED_ERROR, keep_cached=False)
    scheduler.check_integrity()
    assert scheduler.kv.pool.num_free_blocks == 64 - 2  # the stream's two blocks


def test_a_request_finished_in_flight_keeps_its_blocks_until_its_chunk_lands() -> None:
    scheduler = make_scheduler()
    decoding_stream(scheduler)
    scheduler.add_request(make_request("long", 100))
    step(scheduler)
    free = scheduler.kv.pool.num_free_blocks
    finished = scheduler.finish_request("long", RequestStatus.FINISHED_ABORTED)
    assert finished is not None and "long" not in scheduler.requests
    assert scheduler.kv.pool.num_free_blocks == free  # the chunk still writes them
    scheduler.check_integrity()
    assert scheduler.land() is None
    assert scheduler.in_flight is None and scheduler.kv.pool.num_free_blocks == free + STEP // BLOCK
    scheduler.check_integrity()


def test_a_request_in_flight_is_never_the_one_preempted() -> None:
    # 18 blocks: the stream's 2 and the chunk's 16 fill the pool.
    scheduler = make_scheduler(num_blocks=18)
    decoding_stream(scheduler)
    scheduler.add_request(make_request("long", 100))
    assert step(scheduler).background is not None
    assert scheduler.kv.pool.num_free_blocks == 0
    while scheduler.requests["stream"].status == RequestStatus.RUNNING:
        step(scheduler)  # the stream grows until it needs a third block
    # The newest running request is the one in flight; the stream gives way instead.
    assert scheduler.requests["stream"].status == RequestStatus.PREEMPTED
    assert scheduler.requests["long"].status == RequestStatus.RUNNING
    assert len(scheduler.kv.block_ids("long")) == STEP // BLOCK
    assert scheduler.num_preemptions == 1
    assert scheduler.land() is scheduler.requests["long"]
    scheduler.check_integrity()


def test_other_long_prompts_wait_for_the_thread_rather_than_slow_the_steps() -> None:
    scheduler = make_scheduler()
    decoding_stream(scheduler)
    scheduler.add_request(make_request("stream2", 4, first_token=2000))
    step(scheduler)  # two streams decoding: two prompts are still capped
    scheduler.add_request(make_request("a", 30))
    scheduler.add_request(make_request("b", 30, first_token=500))
    plan = step(scheduler)
    assert plan.background is not None and plan.background.request_id == "a"
    assert [i.request_id for i in plan.scheduled] == ["stream", "stream2"]
    assert "b" not in scheduler.requests or scheduler.requests["b"].num_computed_tokens == 0
    assert [i.request_id for i in step(scheduler).scheduled] == ["stream", "stream2"]
    scheduler.land()
    plan = step(scheduler)  # a's last token in the step; b's chunk goes beside
    assert [(i.request_id, len(i.token_ids)) for i in plan.scheduled] == [
        ("stream", 1),
        ("stream2", 1),
        ("a", 1),
    ]
    assert plan.background is not None and plan.background.request_id == "b"


def test_while_a_chunk_is_in_flight_no_long_prompt_runs_in_the_steps_even_uncapped() -> None:
    scheduler = make_scheduler()
    decoding_stream(scheduler)
    scheduler.add_request(make_request("long", 100))
    assert step(scheduler).background is not None
    scheduler.add_request(make_request("a", 30, first_token=500))  # now prompts outnumber streams
    scheduler.add_request(make_request("b", 5, first_token=700))  # short, but behind a (FCFS)
    plan = step(scheduler)
    assert [(i.request_id, len(i.token_ids)) for i in plan.scheduled] == [("stream", 1)]
    assert plan.background is None
    scheduler.land()
    plan = step(scheduler)  # the chunk landed: prompts outnumbering streams run at full budget
    assert [(i.request_id, len(i.token_ids)) for i in plan.scheduled] == [
        ("stream", 1),
        ("long", 100 - STEP),
        ("a", STEP - 1 - (100 - STEP)),
    ]
