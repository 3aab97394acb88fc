"""Profiling engine steps (rebar profile, AsyncEngine.profile): a Chrome trace with a named range
per layer, top operators, and nothing left behind."""

from __future__ import annotations

import asyncio

import pytest

from rebar.engine.async_engine import AsyncEngine
from rebar.engine.profile_run import profile_engine
from rebar.engine.sampling_params import SamplingParams
from rebar.errors import RebarError
from tiny_engine import make_core


def event_names(trace: dict) -> set[str]:
    return {event.get("name") for event in trace["traceEvents"]}


def no_hooks_left(model) -> bool:
    return all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_profile_engine_names_every_layer_and_cleans_up(tmp_path) -> None:
    core = make_core(tmp_path)
    result = profile_engine(core, num_steps=3, batch=2, input_len=8, warmup_steps=1, top=5)
    assert result.num_steps == 3
    names = event_names(result.trace)
    for layer in (
        "embed_tokens",
        "layers.0",
        "layers.1",
        "layers.0.attn",
        "layers.1.mlp",
        "layers.0.input_norm",
        "layers.1.post_attn_norm",
        "norm",
    ):
        assert layer in names, layer
    assert not any(
        name and name.startswith("layers.0.attn.") for name in names
    )  # projections are operators
    assert any(name and name.startswith("aten::") for name in names)
    assert 1 <= len(result.top_operators) <= 5 and "Self CPU" in result.table
    selfs = [op.self_ms for op in result.top_operators]
    assert selfs == sorted(selfs, reverse=True) and all(
        op.calls >= 1 for op in result.top_operators
    )
    assert no_hooks_left(core.runner.model)
    assert (
        not core.has_unfinished_requests()
        and core.kv_manager.pool.num_free_blocks == core.kv_manager.pool.num_blocks
    )


def test_live_engine_profiles_steps_in_its_own_thread(tmp_path) -> None:
    core = make_core(tmp_path)

    async def scenario():
        engine = AsyncEngine(core)
        try:
            idle = await engine.profile(
                num_steps=5, timeout_s=0.2
            )  # no requests: the deadline ends it
            assert idle.num_steps == 0

            params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)

            async def generate():
                return [o async for o in engine.generate("w2 w3 w4 w5", params)]

            busy = asyncio.create_task(generate())
            profiling = asyncio.create_task(engine.profile(num_steps=4, timeout_s=30))
            await asyncio.sleep(0)
            with pytest.raises(RebarError, match="already"):
                await engine.profile(num_steps=1, timeout_s=5)
            result = await profiling
            outputs = await busy
            assert result.num_steps == 4 and "layers.1.mlp" in event_names(result.trace)
            assert (
                sum(len(o.new_token_ids) for o in outputs) == 40
            )  # profiling changed nothing about the answer
        finally:
            engine.shutdown()

    asyncio.run(scenario())
    assert no_hooks_left(core.runner.model)
