"""EngineCore with a long prompt's chunks computed beside its steps (`prefill_beside_decode`), on a
tiny random model: the same tokens as in the steps, and every way such a request can end early
(abort, a failing chunk, a reused id) leaves no block held and no output lost."""

from __future__ import annotations

import os
import random
import threading
import time

import pytest
import torch

from needs import need_linux_proc, requires
from rebar.engine.outputs import DEADLINE_EXCEEDED, ENGINE_FAULT
from rebar.engine.prefill_beside import NICENESS, split_threads
from rebar.engine.sampling_params import SamplingParams
from tiny_engine import VOCAB, make_core, run_to_completion, tokens_of

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
NUM_BLOCKS = 96
CHUNK_THREAD = "rebar-prefill-beside"


def long_prompt(seed: int = 1) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, VOCAB) for _ in range(100)]


def core_with_a_stream(tmp_path, **engine: object):
    """A core (8 prompt tokens a step while decoding, 64 a step) whose 'stream' has started
    decoding."""
    core = make_core(
        tmp_path,
        num_blocks=NUM_BLOCKS,
        max_prefill_tokens_while_decoding=8,
        max_num_batched_tokens=64,
        **engine,
    )
    stream = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    core.add_request("stream", [3, 5, 7, 11], stream)
    core.step()
    return core


def chunks_beside(core) -> int:
    return core.stats().step_seconds["prefill_beside"].num


def test_a_prompt_beside_a_stream_gives_both_the_tokens_the_steps_give(tmp_path) -> None:
    results = {}
    for beside in (True, False):
        core = core_with_a_stream(tmp_path, prefill_beside_decode=beside)
        core.add_request("long", long_prompt(), GREEDY)
        outputs = run_to_completion(core)
        results[beside] = (tokens_of(outputs[("long", 0)]), tokens_of(outputs[("stream", 0)]))
        if beside:
            assert chunks_beside(core) == 2  # 64 tokens, then 35, the last in a step
        else:
            assert "prefill_beside" not in core.stats().step_seconds
        assert core.kv_manager.pool.num_free_blocks == NUM_BLOCKS
    assert results[True] == results[False]
    assert len(results[True][0]) == 12


class HeldChunks:
    """Wraps `runner.execute` so that calls on the chunk's thread wait for `release` (and raise
    when `fail`): a chunk is then in flight for as long as a test needs."""

    def __init__(self, monkeypatch, runner, fail: bool = False) -> None:
        self.release, self.started, self.fail = threading.Event(), threading.Event(), fail
        self.niceness: int | None = None  # the chunk thread's
        self.threads: int | None = None  # the chunk thread's team size
        inner = runner.execute

        def execute(items):
            if threading.current_thread().name == CHUNK_THREAD:
                self.niceness = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
                self.threads = torch.get_num_threads()
                self.started.set()
                assert self.release.wait(30), "the test never released the chunk"
                if self.fail:
                    raise RuntimeError("a fault in the chunk")
            return inner(items)

        monkeypatch.setattr(runner, "execute", execute)


def test_aborting_a_request_in_flight_frees_its_blocks_once_its_chunk_lands(
    tmp_path, monkeypatch
) -> None:
    core = core_with_a_stream(tmp_path)
    held = HeldChunks(monkeypatch, core.runner)
    core.add_request("long", long_prompt(), GREEDY)
    core.step()
    assert held.started.wait(10) and core.beside is not None and core.beside.busy
    (aborted,) = core.abort_request("long")
    assert aborted.finished and aborted.finish_reason == "abort"
    core.check_integrity()
    assert core.kv_manager.pool.num_free_blocks < NUM_BLOCKS - 2  # the chunk's blocks are held
    for _ in range(3):  # the stream goes on meanwhile
        assert [o.request_id for o in core.step()] == ["stream"]
    held.release.set()
    outputs = run_to_completion(core)
    assert outputs[("stream", 0)][-1].num_output_tokens == 30
    assert not core.has_unfinished_requests() and not core.beside.busy
    assert core.kv_manager.pool.num_free_blocks == NUM_BLOCKS


def test_an_idle_engine_collects_the_chunk_of_a_finished_request(tmp_path, monkeypatch) -> None:
    core = make_core(tmp_path, num_blocks=NUM_BLOCKS, max_prefill_tokens_while_decoding=24)
    held = HeldChunks(monkeypatch, core.runner)
    core.add_request("stream", [3, 5], SamplingParams(max_tokens=2, temperature=0))
    core.step()
    core.add_request("long", long_prompt(), GREEDY)
    core.step()  # the stream's last token; the prompt's chunk goes beside
    assert held.started.wait(10)
    core.abort_request("long")
    assert core.scheduler.num_unfinished == 0 and core.has_unfinished_requests()
    assert core.step() == []  # waits a little, the chunk is still held
    held.release.set()
    run_to_completion(core)
    assert core.kv_manager.pool.num_free_blocks == NUM_BLOCKS


def test_a_failing_chunk_fails_its_request_alone(tmp_path, monkeypatch) -> None:
    alone = core_with_a_stream(tmp_path)
    expected = tokens_of(run_to_completion(alone)[("stream", 0)])

    core = core_with_a_stream(tmp_path)
    held = HeldChunks(monkeypatch, core.runner, fail=True)
    held.release.set()
    core.add_request("long", long_prompt(), GREEDY)
    outputs = run_to_completion(core)
    (failed,) = outputs[("long", 0)]
    assert failed.finish_reason == "error" and failed.error == ENGINE_FAULT
    assert tokens_of(outputs[("stream", 0)]) == expected
    assert core.kv_manager.pool.num_free_blocks == NUM_BLOCKS
    # Nothing the failed chunk was to write is served from the prefix cache.
    monkeypatch.undo()
    core.add_request("again", long_prompt(), SamplingParams(max_tokens=1))
    assert run_to_completion(core)[("again", 0)][-1].num_cached_tokens == 0


def test_an_id_reused_while_its_last_chunk_is_in_flight_waits_for_it(tmp_path, monkeypatch) -> None:
    core = core_with_a_stream(tmp_path)
    held = HeldChunks(monkeypatch, core.runner)
    core.add_request("long", long_prompt(), GREEDY)
    core.step()
    assert held.started.wait(10)
    core.abort_request("long")
    threading.Timer(0.2, held.release.set).start()
    core.add_request("long", long_prompt(seed=2), GREEDY)  # returns once the old chunk landed
    assert held.release.is_set() and not core.beside.busy  # it did wait
    outputs = run_to_completion(core)
    assert len(tokens_of(outputs[("long", 0)])) == 12
    assert core.kv_manager.pool.num_free_blocks == NUM_BLOCKS


def test_a_deadline_passing_in_flight_times_the_request_out(tmp_path, monkeypatch) -> None:
    core = core_with_a_stream(tmp_path)
    held = HeldChunks(monkeypatch, core.runner)
    core.add_request("long", long_prompt(), GREEDY, deadline=time.monotonic() + 0.3)
    core.step()
    assert held.started.wait(10)
    timed_out: list = []
    while not timed_out:
        timed_out = [o for o in core.step() if o.request_id == "long"]
    assert timed_out[0].finished and timed_out[0].error == DEADLINE_EXCEEDED
    held.release.set()
    run_to_completion(core)
    assert core.kv_manager.pool.num_free_blocks == NUM_BLOCKS


@requires(need_linux_proc)  # threads have nice levels of their own on Linux
def test_the_chunk_runs_at_a_lower_priority_than_the_steps(tmp_path, monkeypatch) -> None:
    core = core_with_a_stream(tmp_path)
    held = HeldChunks(monkeypatch, core.runner)
    held.release.set()
    core.add_request("long", long_prompt(), GREEDY)
    run_to_completion(core)
    assert held.niceness == os.getpriority(os.PRIO_PROCESS, 0) + NICENESS


@pytest.mark.parametrize(
    "total,chunk_threads,split",
    [
        (2, None, (1, 1)),
        (8, None, (4, 4)),
        (1, None, (1, 1)),
        (8, 2, (2, 6)),
        (2, 2, (2, 2)),
        (2, 5, (2, 2)),
    ],
)
def test_the_threads_are_split_between_the_chunk_and_the_steps(total, chunk_threads, split) -> None:
    assert split_threads(total, chunk_threads) == split


@requires(need_linux_proc)  # the OpenMP runtime is found among /proc/self/maps
@pytest.mark.parametrize("chunk_threads,shares", [(1, (1, 3)), (None, (2, 2)), (4, (4, 4))])
def test_the_steps_run_on_their_share_while_a_chunk_computes(
    tmp_path, monkeypatch, chunk_threads, shares
) -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        core = core_with_a_stream(tmp_path, prefill_beside_threads=chunk_threads)
        held = HeldChunks(monkeypatch, core.runner)
        core.add_request("long", long_prompt(), GREEDY)
        core.step()  # starts the chunk
        assert held.started.wait(30)
        core.step()  # the stream's step beside it
        assert (held.threads, torch.get_num_threads()) == shares
        held.release.set()
        run_to_completion(core)
        assert torch.get_num_threads() == 4  # the engine's thread has all of them back
    finally:
        torch.set_num_threads(before)
