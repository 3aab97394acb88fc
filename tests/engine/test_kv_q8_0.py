"""The 8-bit KV cache (`[engine] kv_cache_dtype = "q8_0"`) through the engine: how much it holds,
that a request's tokens do not depend on batching, chunking, prefix hits or preemption, its cost in
accuracy against the float16 cache, a model it cannot hold, the engine in its own process and the
real SmolLM2 on the fused decode step. Preemption with it: tests/engine/test_core.py."""

from __future__ import annotations

import asyncio

import pytest
import torch
from hf_tiny import build_decoder, save_decoder
from tests.engine.test_core import GREEDY, alone, prompts
from tests.tiny_engine import make_core, run_to_completion, tiny_config, tokens_of

from markers import requires_smollm2
from rebar.engine.engine_config import kv_bytes_per_token
from rebar.engine.engine_process import EngineProcess, EngineSpec
from rebar.engine.sampling_params import SamplingParams
from rebar.errors import InvalidRequestError
from rebar.kernels import kv_quant
from rebar.llm import LLM, engine_config

# Q8_0 rows need head_dim a multiple of 32 (the tiny model's default is 16).
CONFIG = tiny_config(head_dim=32)


def q8_0_core(tmp_path, **engine: object):
    return make_core(tmp_path, config=CONFIG, kv_cache_dtype="q8_0", **engine)


@pytest.mark.parametrize("backend", ["torch", "batched"])
def test_holds_1_88_times_float16s_tokens_and_decodes_alike(tmp_path, backend) -> None:
    """Same memory: 64 / 34 as many blocks as float16. Prefill, chunked prefill (24 tokens a step),
    prefix hits and decode all read the same Q8_0 rows: a batch decodes as each prompt alone does."""
    batch = [*prompts(6, seed=3), prompts(1, seed=3)[0]]  # the repeat hits the prefix cache
    budget = 64 * 4 * kv_bytes_per_token(CONFIG, torch.float16)  # 64 float16 blocks of 4 tokens
    cores = {}
    for dtype in ("float16", "q8_0"):
        core = make_core(
            tmp_path,
            config=CONFIG,
            max_num_batched_tokens=24,
            attention_backend=backend,
            kv_cache_dtype=dtype,
            kv_cache_memory=budget,
        )
        for i, prompt in enumerate(batch):
            core.add_request(str(i), prompt, GREEDY)
        core.results = run_to_completion(core)
        cores[dtype] = core
    eight_bit = cores["q8_0"]
    assert eight_bit.runner.kv_cache.dtype == kv_quant.STORAGE_DTYPE
    assert eight_bit.runner.kv_cache.num_blocks == 64 * 64 // 34 == 120
    assert eight_bit.stats().num_prefix_hits > 0
    for i, prompt in enumerate(batch):
        assert tokens_of(eight_bit.results[(str(i), 0)]) == alone(
            tmp_path,
            prompt,
            GREEDY,
            config=CONFIG,
            attention_backend=backend,
            kv_cache_dtype="q8_0",
        )
    logits = {name: core.runner.teacher_forced_logits(batch[0]) for name, core in cores.items()}
    # 8-bit codes (half a step is up to 1/254 of a block's largest value) move these logits by a few
    # percent at most, and they do move them.
    error = (logits["q8_0"] - logits["float16"]).abs().max() / logits["float16"].abs().max()
    assert 0 < error < 5e-2


def test_a_model_whose_heads_are_not_whole_blocks_is_refused_by_name(tmp_path) -> None:
    with pytest.raises(InvalidRequestError) as info:
        make_core(tmp_path, kv_cache_dtype="q8_0", kv_cache_memory=2**20)  # head_dim 16
    assert info.value.param == "kv_cache_dtype"
    assert "multiple of 32 (the Q8_0 block); this model's is 16" in str(info.value)


def test_the_engine_process_decodes_as_the_engine_in_process(tmp_path) -> None:
    model_dir = save_decoder(
        build_decoder("LlamaForCausalLM", seed=3, head_dim=32, num_key_value_heads=2),
        tmp_path / "m",
    )
    config = engine_config(
        max_model_len=128, kv_cache_memory=2**20, block_size=4, kv_cache_dtype="q8_0"
    )
    prompt = [5, 9, 11, 13]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    in_process = LLM(model_dir, device="cpu", engine_config=config)
    assert in_process.engine.runner.kv_cache.dtype == kv_quant.STORAGE_DTYPE
    reference = in_process.generate(prompt, params)[0]
    engine = EngineProcess.spawn(EngineSpec(str(model_dir), device="cpu", engine_config=config))
    try:

        async def collect() -> list[int]:
            return [t async for o in engine.generate(prompt, params) for t in o.new_token_ids]

        assert asyncio.run(collect()) == reference.token_ids
    finally:
        engine.shutdown()


@requires_smollm2
def test_smollm2_counts_on_over_a_q8_0_cache_on_the_fused_step() -> None:
    llm = LLM("smollm2", kv_cache_dtype="q8_0", max_model_len=512)
    assert (
        llm.engine.runner.fused_decoder is not None
    )  # decode steps take the C++ path over Q8_0 rows
    out = llm.generate("1, 2, 3, 4, 5,", SamplingParams(max_tokens=24, temperature=0))[0]
    assert out.text.startswith(" 6, 7, 8, 9, 10, 11, 12"), out.text
