"""LLM.generate / chat / logits on the real bundled SmolLM2 GGUF: stop conditions, seeds, batching,
errors."""

from __future__ import annotations

import pytest
import torch

from rebar import SamplingParams
from rebar.errors import InvalidRequestError

GREEDY = SamplingParams(max_tokens=16, temperature=0)


def test_chat_answers_a_simple_question(smollm2) -> None:
    # with SmolLM2's default system prompt this 135M model rambles, in llama.cpp exactly as in rebar
    messages = [
        {"role": "system", "content": "You are a helpful AI assistant."},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    out = smollm2.chat(messages, SamplingParams(max_tokens=24, temperature=0))[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"
    assert out.token_ids[-1] in smollm2.tokenizer.special.eos_token_ids
    assert "<|im_end|>" not in out.text


def test_max_tokens_finishes_with_length(smollm2) -> None:
    out = smollm2.generate(
        "Once upon a time", SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    )[0]
    assert out.finish_reason == "length"
    assert len(out.token_ids) == 5
    assert out.text == smollm2.detokenize(out.token_ids)


def test_greedy_continuation_matches_teacher_forced_argmax(smollm2) -> None:
    # A prompt's prefill, decode steps (one row) and teacher forcing (a longer prefill) go through
    # kernels tiled differently, so a near-tie may go either way: there the two tokens' logits must
    # be within `near_tie`. Teacher forcing reads the generated tokens, so the rest still compares.
    near_tie = 0.1
    agreed = 0
    for text in (
        "The first three planets from the sun are",
        "def add(a, b):",
        "My favourite fruit is",
    ):
        prompt = smollm2.tokenize(text)
        out = smollm2.generate(
            [prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        )[0]
        logits = smollm2.logits(prompt + out.token_ids[:-1])[len(prompt) - 1 :]
        for position, chosen in enumerate(out.token_ids):
            expected = int(logits[position].argmax())
            gap = float(logits[position, expected] - logits[position, chosen])
            assert gap < near_tie, (text, position, chosen, expected, gap)
            agreed += chosen == expected
    assert agreed >= 20  # of 24: ties are rare, so the check cannot pass on ties alone


def test_stop_string_cuts_text_and_reports_it(smollm2) -> None:
    base = smollm2.generate("1, 2, 3, 4,", SamplingParams(max_tokens=12, temperature=0))[0].text
    assert " 7" in base, f"the test needs the model to count on; got {base!r}"
    out = smollm2.generate(
        "1, 2, 3, 4,", SamplingParams(max_tokens=12, temperature=0, stop=[" 7"])
    )[0]
    assert out.finish_reason == "stop" and out.stop_reason == " 7"
    assert out.text == base[: base.index(" 7")]


def test_stop_token_id_finishes(smollm2) -> None:
    base = smollm2.generate(
        "1, 2, 3, 4,", SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    )[0]
    stop_id = base.token_ids[2]
    out = smollm2.generate(
        "1, 2, 3, 4,", SamplingParams(max_tokens=6, temperature=0, stop_token_ids=[stop_id])
    )[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    assert out.token_ids == base.token_ids[: base.token_ids.index(stop_id) + 1]


def test_seeded_sampling_is_reproducible_and_seed_sensitive(smollm2) -> None:
    def run(seed: int) -> list[int]:
        params = SamplingParams(max_tokens=12, temperature=1.0, seed=seed, ignore_eos=True)
        return smollm2.generate("My favourite animal is", params)[0].token_ids

    assert run(11) == run(11)
    assert run(11) != run(12)


def test_batched_prompts_match_running_alone(smollm2) -> None:
    prompts = ["The sky is", "def add(a, b):\n", "Bonjour, je m'appelle"]
    together = smollm2.generate(prompts, GREEDY)
    for prompt, out in zip(prompts, together):
        assert smollm2.generate(prompt, GREEDY)[0].token_ids == out.token_ids


def test_logits_shape_and_dtype(smollm2) -> None:
    ids = smollm2.tokenize("Hello there")
    logits = smollm2.logits(ids)
    assert (
        logits.shape == (len(ids), smollm2.tokenizer.vocab_size) and logits.dtype == torch.float32
    )


@pytest.mark.parametrize(
    ("call", "param"),
    [
        (lambda llm: llm.generate("", GREEDY), "prompt"),
        (lambda llm: llm.generate([[1, 2, 10**9]], GREEDY), "prompt"),
        (
            lambda llm: llm.generate("hi", SamplingParams(max_tokens=llm.max_model_len)),
            "max_tokens",
        ),
        (lambda llm: llm.generate([[1] * llm.max_model_len], GREEDY), "prompt"),
        (lambda llm: llm.logits([]), "prompt"),
        (lambda llm: llm.logits([-1]), "prompt"),
        (lambda llm: llm.embed(["x"]), "model"),
        (lambda llm: llm.generate(["a", "b"], [GREEDY]), "params"),
        (lambda llm: llm.chat([{"role": "user"}]), "messages"),
    ],
)
def test_bad_input_raises_a_typed_error(smollm2, call, param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        call(smollm2)
    assert info.value.param == param


def test_embedding_model_refuses_to_generate(minilm) -> None:
    with pytest.raises(InvalidRequestError, match="embedding model"):
        minilm.generate("hi", GREEDY)
