"""EngineProcess: the core in a child process, checked against the same model run in this one."""

from __future__ import annotations

import asyncio
import os
import signal
from dataclasses import replace

import pytest
from hf_tiny import build_decoder, save_decoder

from rebar.engine.async_engine import EngineUnavailableError
from rebar.engine.engine_process import EngineProcess, EngineSpec
from rebar.engine.outputs import ENGINE_FAULT, ENGINE_SHUTDOWN
from rebar.engine.sampling_params import SamplingParams
from rebar.errors import InvalidRequestError, ModelNotFoundError, RebarError
from rebar.llm import LLM, engine_config
from waiting import wait_until

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
CONFIG = engine_config(max_model_len=128, kv_cache_memory=2**20, block_size=4, speculative=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_decoder(build_decoder("LlamaForCausalLM", seed=3), tmp_path_factory.mktemp("m"))


@pytest.fixture(scope="module")
def engine(model_dir):
    engine = EngineProcess.spawn(EngineSpec(str(model_dir), device="cpu", engine_config=CONFIG))
    yield engine
    engine.shutdown()


async def collect(engine, prompt, params=GREEDY, **kwargs) -> list:
    return [output async for output in engine.generate(prompt, params, **kwargs)]


def tokens(outputs, index: int = 0) -> list[int]:
    return [t for o in outputs if o.index == index for t in o.new_token_ids]


def test_streams_the_tokens_the_same_model_generates_in_process(engine, model_dir) -> None:
    prompt = [5, 9, 11, 13]
    reference = LLM(model_dir, device="cpu", engine_config=CONFIG).generate(prompt, GREEDY)[0]
    outputs = asyncio.run(collect(engine, prompt))
    assert tokens(outputs) == reference.token_ids
    assert outputs[-1].finished and outputs[-1].finish_reason == "length"
    assert "".join(o.text_delta for o in outputs) == reference.text
    assert outputs[-1].timing is not None and outputs[-1].num_prompt_tokens == 4


def test_front_end_admits_like_the_core(engine) -> None:
    assert engine.max_model_len == 128
    with pytest.raises(InvalidRequestError) as info:
        engine.admit([3] * 200, GREEDY)
    assert info.value.param == "prompt"
    with pytest.raises(InvalidRequestError) as info:
        engine.admit([3], SamplingParams(max_tokens=10, logit_bias={10_000: 1.0}))
    assert "logit_bias" in (info.value.param or "")


def test_n_choices_and_concurrent_requests_each_get_their_own_outputs(engine) -> None:
    async def main():
        params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, n=2)
        return await asyncio.gather(
            collect(engine, [4, 5, 6], params), collect(engine, [7, 8], GREEDY, request_id="same")
        )

    both, single = asyncio.run(main())
    assert {o.index for o in both if o.finished} == {0, 1}
    assert tokens(both, 0) == tokens(both, 1)  # greedy: the two choices agree
    assert len(tokens(single)) == 12 and {o.request_id for o in single} == {single[0].request_id}
    assert single[0].request_id.startswith("same@")


def test_leaving_a_stream_aborts_it_and_frees_its_blocks(engine) -> None:
    total = engine.stats().num_blocks

    async def main():
        stream = engine.generate(
            [3, 4], SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
        )
        async for _output in stream:
            break  # the consumer leaves after the first token
        await stream.aclose()

    asyncio.run(main())
    assert wait_until(
        lambda: engine.stats().num_free_blocks == total and not engine.stats().num_running
    )
    assert asyncio.run(collect(engine, [3, 4]))[-1].finish_reason == "length"  # still serving


def test_counts_decode_steps_in_its_step_histogram(engine) -> None:
    before = engine.stats().step_seconds["decode"].num
    one_per_step = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, speculative=False)
    asyncio.run(collect(engine, [6, 7], one_per_step))
    after = engine.stats().step_seconds["decode"]
    assert after.num >= before + 11  # 12 tokens: one prefill step, then a decode step each
    assert after.total_s > 0 and sum(after.counts) == after.num


def test_speculative_decoding_in_the_child_changes_no_token(engine, model_dir) -> None:
    """A prompt that repeats itself gives the n-gram drafter matches; the child's drafts and their
    counts cross the process boundary, and the tokens are those of decoding without drafts."""
    prompt = [5, 6, 7, 8, 9] * 6
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    plain = replace(CONFIG, speculative=False)
    reference = LLM(model_dir, device="cpu", engine_config=plain).generate(prompt, params)[0]
    outputs = asyncio.run(collect(engine, prompt, params))
    assert tokens(outputs) == reference.token_ids
    counts = engine.stats().drafts["ngram"]
    assert counts.num_accepted <= counts.num_drafted


def test_profiles_steps_in_the_child(engine) -> None:
    async def main():
        profile = asyncio.ensure_future(engine.profile(num_steps=3, timeout_s=20))
        await asyncio.sleep(0.2)
        await collect(engine, [8, 9])
        return await profile

    result = asyncio.run(main())
    assert result.num_steps == 3 and result.trace.get("traceEvents")


def test_a_bad_model_fails_the_spawn_with_the_childs_message(tmp_path) -> None:
    with pytest.raises(ModelNotFoundError, match="no-such-model"):
        EngineProcess.spawn(
            EngineSpec(str(tmp_path / "no-such-model"), engine_config=CONFIG, device="cpu")
        )


def test_stopping_ends_running_requests_and_refuses_new_ones(model_dir) -> None:
    engine = EngineProcess.spawn(EngineSpec(str(model_dir), device="cpu", engine_config=CONFIG))
    long = SamplingParams(max_tokens=120, temperature=0, ignore_eos=True)

    async def main():
        stream = engine.generate([3], long)
        first = await stream.__anext__()
        await asyncio.to_thread(engine.shutdown)
        return [first] + [o async for o in stream]

    outputs = asyncio.run(main())
    assert outputs[-1].finished and outputs[-1].finish_reason == "error"
    assert outputs[-1].error == ENGINE_SHUTDOWN
    assert not engine.is_running and engine.failure == "the engine stopped"
    with pytest.raises(EngineUnavailableError):
        asyncio.run(collect(engine, [3]))


def test_a_child_that_dies_fails_its_streams_and_says_why(model_dir) -> None:
    engine = EngineProcess.spawn(EngineSpec(str(model_dir), device="cpu", engine_config=CONFIG))
    long = SamplingParams(max_tokens=120, temperature=0, ignore_eos=True)

    async def main():
        stream = engine.generate([3], long)
        first = await stream.__anext__()
        os.kill(engine._process.pid, signal.SIGKILL)
        return [first] + [o async for o in stream]

    try:
        outputs = asyncio.run(main())
        assert outputs[-1].finish_reason == "error" and outputs[-1].error == ENGINE_FAULT
        assert wait_until(lambda: engine.failure is not None)
        assert "exited" in engine.failure and str(-signal.SIGKILL) in engine.failure
        assert not engine.is_running
        with pytest.raises(RebarError):
            asyncio.run(collect(engine, [3]))
    finally:
        engine.shutdown()


def test_structured_outputs_are_checked_in_front_as_in_the_core(engine) -> None:
    from rebar.engine.structured import StructuredOutput

    params = SamplingParams(structured=StructuredOutput.json_schema({"type": "object"}))
    with pytest.raises(InvalidRequestError) as info:  # this tiny tokenizer has no decoder
        engine.admit([5, 9], params)
    assert info.value.param == "response_format" and "constrained outputs" in str(info.value)
