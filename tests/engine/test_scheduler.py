"""Scheduler with hand-built requests and no model: budgets, chunking, FCFS, preemption, aborts."""

from __future__ import annotations

import pytest

from rebar import SamplingParams
from rebar.engine.kv_cache_manager import KVCacheManager
from rebar.engine.request import Request, RequestStatus
from rebar.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput

BLOCK = 4


def make_scheduler(
    num_blocks: int = 64, max_num_seqs: int = 8, max_tokens: int = 64, prefix: bool = True
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_seqs, max_tokens), KVCacheManager(num_blocks, BLOCK, prefix)
    )


def make_request(
    request_id: str, num_prompt: int, max_new: int = 8, first_token: int = 0
) -> Request:
    prompt = list(range(first_token, first_token + num_prompt))
    return Request(
        request_id,
        prompt,
        SamplingParams(max_tokens=max_new),
        max_total_tokens=num_prompt + max_new,
    )


def run_step(scheduler: Scheduler, next_token: int = 7) -> SchedulerOutput:
    """What the engine core does after the model ran: advance, then append a token where sampled."""
    plan = scheduler.schedule()
    scheduler.update_after_step(plan)
    for item in plan.scheduled:
        if item.sample:
            scheduler.requests[item.request_id].append_output(next_token)
    scheduler.check_integrity()
    return plan


def test_prefill_then_decode_one_token_at_a_time() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 10))
    first = run_step(scheduler)
    assert [
        (s.request_id, len(s.token_ids), s.start_position, s.sample) for s in first.scheduled
    ] == [("a", 10, 0, True)]
    second = run_step(scheduler)
    assert [(len(s.token_ids), s.start_position, s.sample) for s in second.scheduled] == [
        (1, 10, True)
    ]
    assert second.scheduled[0].token_ids == (7,)


def test_long_prompt_is_chunked_under_the_token_budget() -> None:
    scheduler = make_scheduler(max_tokens=16)
    scheduler.add_request(make_request("a", 40))
    plans = [run_step(scheduler) for _ in range(3)]
    assert [len(p.scheduled[0].token_ids) for p in plans] == [16, 16, 8]
    assert [p.scheduled[0].sample for p in plans] == [False, False, True]
    assert [p.scheduled[0].start_position for p in plans] == [0, 16, 32]


def test_running_requests_go_first_and_waiting_ones_fill_the_budget_in_order() -> None:
    scheduler = make_scheduler(max_tokens=12)
    scheduler.add_request(make_request("a", 4))
    run_step(scheduler)
    scheduler.add_request(make_request("b", 8, first_token=100))
    scheduler.add_request(make_request("c", 8, first_token=200))
    plan = run_step(scheduler)
    assert [(s.request_id, len(s.token_ids)) for s in plan.scheduled] == [
        ("a", 1),
        ("b", 8),
        ("c", 3),
    ]


def test_max_num_seqs_limits_admission() -> None:
    scheduler = make_scheduler(max_num_seqs=2)
    for name in "abc":
        scheduler.add_request(make_request(name, 2))
    assert [s.request_id for s in run_step(scheduler).scheduled] == ["a", "b"]
    scheduler.finish_request("a", RequestStatus.FINISHED_STOPPED)
    assert [s.request_id for s in run_step(scheduler).scheduled] == ["b", "c"]


def test_block_shortage_preempts_the_newest_and_it_recomputes_later() -> None:
    scheduler = make_scheduler(num_blocks=4, prefix=False)  # 16 token slots
    scheduler.add_request(make_request("old", 7, max_new=9))
    scheduler.add_request(make_request("new", 7, max_new=9, first_token=100))
    run_step(scheduler)  # both prefilled: 2 blocks each, full pool
    plan = run_step(scheduler)  # each needs an 8th slot: fits in its 2nd block
    assert {s.request_id for s in plan.scheduled} == {"old", "new"}
    plan = run_step(scheduler)  # 9th token needs a 3rd block: none free -> "new" is preempted
    assert [s.request_id for s in plan.scheduled] == ["old"]
    assert scheduler.num_preemptions == 1
    new = scheduler.requests["new"]
    assert (
        new.status == RequestStatus.PREEMPTED
        and new.num_computed_tokens == 0
        and new.num_preemptions == 1
    )
    scheduler.finish_request("old", RequestStatus.FINISHED_STOPPED)
    plan = run_step(scheduler)
    assert plan.scheduled[0].request_id == "new"
    assert (
        plan.scheduled[0].start_position == 0 and len(plan.scheduled[0].token_ids) == 9
    )  # prompt + 2 outputs
    assert plan.scheduled[0].sample


def test_preempted_request_returns_first_in_line() -> None:
    scheduler = make_scheduler(num_blocks=4, max_num_seqs=4, prefix=False)
    scheduler.add_request(make_request("a", 7, max_new=9))
    scheduler.add_request(make_request("b", 7, max_new=9))
    run_step(scheduler)
    run_step(scheduler)
    run_step(scheduler)  # b preempted
    scheduler.add_request(make_request("c", 2))
    assert [r.request_id for r in scheduler.waiting] == ["b", "c"]


def test_prefix_hit_skips_cached_blocks() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 10))
    run_step(scheduler)
    scheduler.add_request(make_request("b", 10))
    plan = run_step(scheduler)
    b = next(s for s in plan.scheduled if s.request_id == "b")
    assert (
        b.start_position == 8 and len(b.token_ids) == 2
    )  # two full blocks of 4 came from the cache
    assert scheduler.requests["b"].num_cached_tokens == 8


def test_abort_of_waiting_and_running_requests_frees_everything() -> None:
    scheduler = make_scheduler(max_num_seqs=1)
    scheduler.add_request(make_request("run", 6))
    scheduler.add_request(make_request("wait", 6))
    run_step(scheduler)
    assert (
        scheduler.finish_request("wait", RequestStatus.FINISHED_ABORTED).status
        == RequestStatus.FINISHED_ABORTED
    )
    scheduler.finish_request("run", RequestStatus.FINISHED_ABORTED)
    assert (
        scheduler.finish_request("run", RequestStatus.FINISHED_ABORTED) is None
    )  # unknown now: ignored
    assert scheduler.num_unfinished == 0
    scheduler.check_integrity()
    assert scheduler.kv.pool.num_free_blocks == scheduler.kv.pool.num_blocks


def test_finished_states_sort_after_live_ones() -> None:
    live = [RequestStatus.WAITING, RequestStatus.RUNNING, RequestStatus.PREEMPTED]
    assert all(not s.is_finished for s in live)
    assert all(s.is_finished for s in RequestStatus if s not in live)
    assert RequestStatus.FINISHED_LENGTH.finish_reason == "length"


def make_capped_scheduler(max_tokens: int = 64, prompt_cap: int = 6) -> Scheduler:
    return Scheduler(SchedulerConfig(8, max_tokens, prompt_cap), KVCacheManager(64, BLOCK, True))


def test_prompts_take_at_most_the_cap_of_a_step_while_as_many_requests_decode() -> None:
    scheduler = make_capped_scheduler()
    scheduler.add_request(make_request("a", 10, max_new=40))
    first = run_step(scheduler)  # nothing decodes yet: the whole prompt in one step
    assert [(s.request_id, len(s.token_ids)) for s in first.scheduled] == [("a", 10)]
    scheduler.add_request(make_request("b", 20, first_token=100))
    plans = [run_step(scheduler) for _ in range(5)]
    shapes = [[(s.request_id, len(s.token_ids)) for s in p.scheduled] for p in plans]
    # One request decodes, one has a prompt: "a" gets a token every step, "b" 6 prompt tokens.
    assert shapes == [
        [("a", 1), ("b", 6)],
        [("a", 1), ("b", 6)],
        [("a", 1), ("b", 6)],
        [("a", 1), ("b", 2)],
        [("a", 1), ("b", 1)],
    ]
    assert [s.sample for s in plans[3].scheduled] == [True, True]  # "b"'s prompt ended
    assert all(p.scheduled[0].sample for p in plans)  # "a" never missed a token


def test_more_prompts_than_decoding_requests_prefill_at_full_speed() -> None:
    """The cap spares the decoding requests' next tokens at the cost of every prompt in line: with
    more prompts waiting than requests decoding, the step's whole budget goes on."""
    scheduler = make_capped_scheduler(max_tokens=16)
    scheduler.add_request(make_request("a", 10, max_new=40))
    run_step(scheduler)
    scheduler.add_request(make_request("b", 20, first_token=100))
    scheduler.add_request(make_request("c", 9, first_token=200))
    plans = [run_step(scheduler) for _ in range(3)]
    # One decoding, two prompts: no cap ("c" waits for the budget, not for the cap).
    assert [[(s.request_id, len(s.token_ids)) for s in p.scheduled] for p in plans] == [
        [("a", 1), ("b", 15)],
        [("a", 1), ("b", 5), ("c", 9)],
        [("a", 1), ("b", 1), ("c", 1)],
    ]
    scheduler.add_request(make_request("d", 20, first_token=300))
    plan = run_step(scheduler)  # three decoding, one prompt: the cap again
    assert [(s.request_id, len(s.token_ids)) for s in plan.scheduled] == [
        ("a", 1),
        ("b", 1),
        ("c", 1),
        ("d", 6),
    ]


def test_requests_that_cannot_be_admitted_do_not_lift_the_cap() -> None:
    """With every sequence slot taken, the waiting requests wait for a decoding one to finish: a
    running prompt beside one decoding request keeps the cap however many wait."""
    scheduler = Scheduler(SchedulerConfig(2, 64, 6), KVCacheManager(64, BLOCK, True))
    scheduler.add_request(make_request("a", 10, max_new=40))
    run_step(scheduler)
    for name in "bcd":
        scheduler.add_request(make_request(name, 20, first_token=100))
    plan = run_step(scheduler)  # "b" takes the last slot; "c" and "d" cannot be admitted
    assert [(s.request_id, len(s.token_ids)) for s in plan.scheduled] == [("a", 1), ("b", 6)]
    plan = run_step(scheduler)
    assert [(s.request_id, len(s.token_ids)) for s in plan.scheduled] == [("a", 1), ("b", 6)]


def test_without_a_decoding_request_a_prompt_gets_the_whole_budget() -> None:
    scheduler = make_capped_scheduler(max_tokens=16)
    scheduler.add_request(make_request("a", 40))
    scheduler.add_request(make_request("b", 3, first_token=100))
    plans = [run_step(scheduler) for _ in range(3)]
    # Nothing decodes until both prompts are done: each step takes its whole budget of prompt
    # tokens, well over the cap of 6 (16, 16, then the two prompts' last 8 + 3 together).
    assert [[(s.request_id, len(s.token_ids)) for s in p.scheduled] for p in plans] == [
        [("a", 16)],
        [("a", 16)],
        [("a", 8), ("b", 3)],
    ]


def test_running_rows_are_what_the_step_gives_the_running_requests() -> None:
    """The speculator prices a step from these rows: a capped prompt counts its cap, not its rest."""
    scheduler = make_capped_scheduler()
    scheduler.add_request(make_request("a", 10, max_new=40))
    run_step(scheduler)
    scheduler.add_request(make_request("b", 30, first_token=100))
    plan = run_step(scheduler)  # admits "b" with 6 of its 30 prompt tokens
    assert scheduler.running_rows() == 1 + 6 == sum(len(s.token_ids) for s in plan.scheduled)
    plain = make_scheduler(max_tokens=16)
    plain.add_request(make_request("c", 40))
    assert plain.running_rows() == 0  # nothing running yet: waiting prompts are not counted
    run_step(plain)
    assert plain.running_rows() == 16


def test_a_prompt_cap_below_one_is_refused() -> None:
    with pytest.raises(AssertionError):
        SchedulerConfig(8, 64, 0)
    assert SchedulerConfig(8, 64, None).max_prefill_tokens_while_decoding is None
