"""Speculative decoding on the bundled quantized models (SmolLM2, Gemma 3): everything equal to the
bit, and n-gram drafts that hold where the answer copies its prompt.

Both run on the fused CPU decode step, where a draft's verification rows compute exactly what
decode steps would: greedy tokens, seeded sampled tokens and their logprobs must all be equal to
decoding without speculation, not merely close.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import pytest

from rebar import SamplingParams
from rebar.engine.spec.build import build_speculator
from rebar.engine.spec.ngram import NgramDrafter
from rebar.engine.spec.policy import StepCost
from rebar.engine.spec.speculator import Speculator

FUNCTION = """def area(width, height):
    if width <= 0 or height <= 0:
        raise ValueError("sizes must be positive")
    result = width * height
    return result
"""
COPY = f"Rewrite this function with `result` renamed to `total`:\n\n{FUNCTION}"


@pytest.fixture(params=["smollm2", "gemma3"])
def llm(request: pytest.FixtureRequest) -> Iterator:
    model = request.getfixturevalue(request.param)
    core = model.engine
    assert core.runner.fused_decoder is not None  # the path whose numbers must be exact
    saved = core.speculator
    yield model
    core.speculator = saved


def run(model, speculate: bool, prompts: list[list[int]], params: SamplingParams):
    """Outputs with the n-gram drafter drafting every slot it can (drafts priced as free), or
    without speculation."""
    core = model.engine
    flat = StepCost([(1, 1.0), (2, 1.0)])
    core.speculator = Speculator(NgramDrafter(), flat, max_draft_tokens=8) if speculate else None
    outputs = model.generate(prompts, params)
    return outputs, (core.speculator.counts if speculate else None)


def test_greedy_and_seeded_outputs_and_logprobs_are_equal_to_the_bit(llm) -> None:
    prompts = [
        llm.chat_prompt_ids([{"role": "user", "content": COPY}]),
        llm.tokenize("One, two, three, four, five, six, seven, eight, nine, ten, one, two,"),
    ]
    # The first run computes the prompts cold, the others after prefix hits on them: the same bits
    # (docs/kernels.md, "Prompt attention and the prefix cache").
    for params in (
        SamplingParams(max_tokens=80, temperature=0, logprobs=2, ignore_eos=True),
        SamplingParams(max_tokens=60, temperature=0.8, seed=5, logprobs=1, ignore_eos=True),
    ):
        plain, _ = run(llm, False, prompts, params)
        speculative, counts = run(llm, True, prompts, params)
        for ours, theirs in zip(speculative, plain):
            assert ours.token_ids == theirs.token_ids
            assert ours.text == theirs.text
            assert ours.choices[0].logprobs == theirs.choices[0].logprobs  # equal floats
        assert counts.num_accepted > 10  # the copies were drafted, and held


def test_default_speculation_drafts_where_the_answer_copies(smollm2) -> None:
    """With the engine's own policy (the speculator `[engine] speculative = true` builds, priced by
    this machine's measured step costs), a copying answer keeps drafts."""
    core = smollm2.engine
    saved = core.speculator
    config = replace(core.config, speculative=True)
    core.speculator = build_speculator(config, core.runner, core.kv_manager.pool.num_blocks)
    try:
        prompt = smollm2.chat_prompt_ids([{"role": "user", "content": COPY}])
        smollm2.generate([prompt], SamplingParams(max_tokens=80, temperature=0))
        assert core.speculator.counts.num_accepted > 0
    finally:
        core.speculator = saved


def test_a_fresh_gemma3_with_the_defaults_stays_within_the_memory_bound(gemma3) -> None:
    """Timing the verification steps at load makes logits of up to 32 rows of Gemma 3's 262,144
    words (a MiB a row); they must not stay resident (what stays once loaded within 16 MiB of a
    process that does not speculate; a kept copy is 32 MiB), nor push the peak past `rebar bench
    compare`'s bound (the file, the KV cache used and 400 MiB)."""
    from pathlib import Path

    from rebar_bench.compare import measure_memory

    assert gemma3.engine.speculator is not None  # the defaults speculate
    path = Path(gemma3.checkpoint.path)
    memory = measure_memory("gemma3", path, threads=2)
    assert memory.peak_bytes <= memory.bound_bytes
    plain = measure_memory("gemma3", path, 2, {"speculative": False})
    assert memory.loaded_bytes - plain.loaded_bytes < 16 * 2**20, (memory, plain)


def test_the_head_finding_greedy_tokens_alone_gives_the_tokens_of_the_logits(llm) -> None:
    """Steps whose rows are all plain greedy skip the logits (the quantized head keeps each row's
    best output as it computes them, kernels/best_outputs); asking for logprobs gives the same
    steps logits: the tokens are equal, with and without drafts to check."""
    head = llm.model.lm_head
    assert head.decode_kernel_name == "native" and head.bias is None  # best_outputs' own path
    prompts = [
        llm.chat_prompt_ids([{"role": "user", "content": COPY}]),
        llm.tokenize("One, two, three, four, five, six, seven, eight, nine, ten, one, two,"),
        llm.tokenize("The history of the harbour town begins"),
    ]
    with_logits = SamplingParams(max_tokens=64, temperature=0, logprobs=1, ignore_eos=True)
    best_only = replace(with_logits, logprobs=None)
    for speculate in (False, True):
        reference, _ = run(llm, speculate, prompts, with_logits)
        ours, _ = run(llm, speculate, prompts, best_only)
        assert [o.token_ids for o in ours] == [r.token_ids for r in reference]
