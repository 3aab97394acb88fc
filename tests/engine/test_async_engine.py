"""AsyncEngine: the core in its own thread, streamed outputs, aborts when the consumer leaves."""

from __future__ import annotations

import asyncio
import time

import pytest

from rebar.engine.async_engine import AsyncEngine
from rebar.engine.outputs import ENGINE_FAULT
from rebar.engine.sampling_params import SamplingParams
from rebar.errors import InvalidRequestError
from tiny_engine import make_core, run_to_completion, tokens_of
from waiting import wait_until

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


@pytest.fixture
def engine(tmp_path):
    engine = AsyncEngine(make_core(tmp_path))
    yield engine
    engine.shutdown()


async def collect(engine: AsyncEngine, prompt, params, request_id=None, cache_salt=None) -> list:
    return [
        output
        async for output in engine.generate(prompt, params, request_id, cache_salt=cache_salt)
    ]


def reference_tokens(tmp_path, prompt: list[int], params: SamplingParams) -> list[int]:
    core = make_core(tmp_path)
    core.add_request("reference", prompt, params)
    return tokens_of(run_to_completion(core)[("reference", 0)])


def test_streams_the_same_tokens_as_the_core(engine, tmp_path) -> None:
    outputs = asyncio.run(collect(engine, [3, 4, 5], GREEDY))
    reference = make_core(tmp_path)
    reference.add_request("r", [3, 4, 5], GREEDY)
    assert tokens_of(outputs) == tokens_of(run_to_completion(reference)[("r", 0)])
    assert len(outputs) == 10 and outputs[-1].finished and not any(o.finished for o in outputs[:-1])


def test_concurrent_requests_all_complete(engine) -> None:
    async def main():
        return await asyncio.gather(*(collect(engine, [3 + i, 4, 5], GREEDY) for i in range(12)))

    results = asyncio.run(main())
    assert all(len(tokens_of(r)) == 10 and r[-1].finish_reason == "length" for r in results)
    assert wait_until(lambda: engine.core.stats().num_free_blocks == engine.core.stats().num_blocks)


def test_leaving_the_stream_aborts_and_frees_blocks_within_a_second(engine) -> None:
    async def main():
        stream = engine.generate(
            [3, 4, 5, 6], SamplingParams(max_tokens=100, ignore_eos=True), "leaver"
        )
        async for _ in stream:
            break
        await stream.aclose()

    asyncio.run(main())
    core = engine.core
    assert wait_until(lambda: not core.has_unfinished_requests())
    assert wait_until(lambda: core.stats().num_free_blocks == core.stats().num_blocks)


def test_cancelled_task_aborts(engine) -> None:
    async def main():
        task = asyncio.create_task(
            collect(engine, [3, 4], SamplingParams(max_tokens=120, ignore_eos=True))
        )
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert wait_until(lambda: not engine.core.has_unfinished_requests())


def test_explicit_abort_finishes_with_reason_abort(engine) -> None:
    async def main():
        outputs = []
        async for output in engine.generate(
            [3, 4], SamplingParams(max_tokens=120, ignore_eos=True), "victim"
        ):
            outputs.append(output)
            if len(outputs) == 2:
                engine.abort(output.request_id)
        return outputs

    outputs = asyncio.run(main())
    assert outputs[-1].finished and outputs[-1].finish_reason == "abort"
    assert len(outputs) < 120


def test_invalid_request_raises_in_the_caller(engine) -> None:
    with pytest.raises(InvalidRequestError) as info:
        asyncio.run(collect(engine, [3] * 200, GREEDY))
    assert info.value.param == "prompt"
    asyncio.run(collect(engine, [3, 4], GREEDY))  # the engine keeps serving


def test_timeout_finishes_the_request(engine) -> None:
    async def main():
        return [
            o
            async for o in engine.generate(
                [3, 4], SamplingParams(max_tokens=120, ignore_eos=True), timeout=0.0
            )
        ]

    outputs = asyncio.run(main())
    assert outputs[-1].finish_reason == "timeout"


def test_n_choices_stream_until_all_finish(engine) -> None:
    outputs = asyncio.run(
        collect(
            engine,
            [3, 4],
            SamplingParams(max_tokens=5, n=3, temperature=1.0, seed=1, ignore_eos=True),
        )
    )
    assert sorted(o.index for o in outputs if o.finished) == [0, 1, 2]


def test_shutdown_fails_in_flight_requests(tmp_path) -> None:
    engine = AsyncEngine(make_core(tmp_path))

    async def main():
        stream = engine.generate([3, 4], SamplingParams(max_tokens=120, ignore_eos=True))
        first = await stream.__anext__()
        engine.shutdown()
        return [first] + [o async for o in stream]

    outputs = asyncio.run(main())
    assert outputs[-1].finished and outputs[-1].finish_reason == "error"


def test_calls_sharing_a_request_id_label_each_get_their_own_outputs(engine, tmp_path) -> None:
    prompts = [[3, 4, 5], [9, 8, 7, 6], [20, 21]]

    async def main():
        return await asyncio.gather(
            *(collect(engine, prompt, GREEDY, "same-label") for prompt in prompts)
        )

    results = asyncio.run(main())
    for prompt, outputs in zip(prompts, results):
        assert tokens_of(outputs) == reference_tokens(tmp_path, prompt, GREEDY)
        assert outputs[-1].finish_reason == "length"
        assert len({o.request_id for o in outputs}) == 1 and outputs[0].request_id.startswith(
            "same-label@"
        )
    assert len({outputs[0].request_id for outputs in results}) == len(prompts)


def test_a_label_reused_right_after_its_stream_was_abandoned_gets_only_its_own_outputs(
    engine, tmp_path, monkeypatch
) -> None:
    """The abandoned request's abort waits in the inbox while a slow step still produces its tokens."""
    real_step = engine.core.step

    def slow_step():
        time.sleep(0.1)
        return real_step()

    monkeypatch.setattr(engine.core, "step", slow_step)
    long = SamplingParams(max_tokens=100, ignore_eos=True, temperature=0)

    async def main():
        first = engine.generate([3, 4, 5, 6], long, "reused")
        async for _ in first:
            break
        await first.aclose()  # client gone mid-stream; its abort is queued behind the running step
        return await collect(engine, [30, 31, 32], GREEDY, "reused")

    outputs = asyncio.run(main())
    assert tokens_of(outputs) == reference_tokens(tmp_path, [30, 31, 32], GREEDY)
    assert outputs[-1].finish_reason == "length" and not any(o.finished for o in outputs[:-1])
    assert wait_until(lambda: not engine.core.has_unfinished_requests())


def test_cache_salt_reaches_the_prefix_cache(engine) -> None:
    prompt = list(range(2, 30))

    def cached(salt: str | None) -> int:
        return asyncio.run(collect(engine, prompt, GREEDY, cache_salt=salt))[-1].num_cached_tokens

    assert [cached("a"), cached("b"), cached("a"), cached(None)] == [0, 0, 24, 0]


def test_an_admitted_request_is_not_checked_again(engine, monkeypatch) -> None:
    real_check = engine.core.checker._check_prompt
    checked = []

    def counting_check(prompt):
        checked.append(list(prompt))
        return real_check(prompt)

    monkeypatch.setattr(engine.core.checker, "_check_prompt", counting_check)
    outputs = asyncio.run(collect(engine, [3, 4, 5], GREEDY))
    assert outputs[-1].finish_reason == "length"
    assert checked == [[3, 4, 5]]  # admission scanned the prompt once; the core trusted it


def test_a_request_another_core_admitted_is_checked_by_the_core_that_runs_it(
    engine, tmp_path
) -> None:
    roomier = make_core(tmp_path, max_model_len=256)
    admitted = roomier.admit([3] * 200, GREEDY)  # too long for the engine's 128-token window

    async def main():
        return [o async for o in engine.generate_admitted(admitted)]

    with pytest.raises(InvalidRequestError) as info:
        asyncio.run(main())
    assert info.value.param == "prompt"
    assert asyncio.run(collect(engine, [3, 4], GREEDY))[-1].finish_reason == "length"


def test_a_fault_while_queueing_fails_that_request_not_the_engine(engine, monkeypatch) -> None:
    real_add = engine.core.add_admitted

    def add_once_broken(request_id, *args, **kwargs):
        monkeypatch.setattr(engine.core, "add_admitted", real_add)
        raise RuntimeError("queueing broke")

    monkeypatch.setattr(engine.core, "add_admitted", add_once_broken)
    params = SamplingParams(max_tokens=4, n=2, temperature=0, ignore_eos=True)
    failed = asyncio.run(collect(engine, [3, 4], params))
    assert sorted(o.index for o in failed) == [0, 1]
    assert all(o.finish_reason == "error" and o.error == ENGINE_FAULT for o in failed)
    assert asyncio.run(collect(engine, [3, 4], GREEDY))[-1].finish_reason == "length"
