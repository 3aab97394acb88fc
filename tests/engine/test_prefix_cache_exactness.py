"""A prompt gets the same bits whatever the prefix cache held and however it was cut into chunks,
on the bundled quantized models (SmolLM2, Gemma 3): greedy tokens and their log-probabilities after
a hit of any length, and with the prompt chunked beside a decoding stream, equal the prompt's cold
run exactly (docs/kernels.md, "Prompt attention and the prefix cache").

Each scenario has a cache salt of its own, so nothing another one cached is found.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from rebar import SamplingParams
from tiny_engine import run_to_completion, tokens_of

ANSWER = SamplingParams(max_tokens=6, temperature=0, logprobs=3, ignore_eos=True)


@pytest.fixture(params=["smollm2", "gemma3"])
def llm(request: pytest.FixtureRequest) -> Iterator:
    yield request.getfixturevalue(request.param)


def answer(core, request_id: str, prompt: list[int], salt: str, params=ANSWER):
    core.add_request(request_id, prompt, params, cache_salt=salt)
    outputs = run_to_completion(core)[(request_id, 0)]
    logprobs = [lp for output in outputs for lp in output.logprobs]
    return tokens_of(outputs), logprobs, outputs[-1].num_cached_tokens


PASSAGE = (
    "The harbour town grew around a single stone quay built by fishermen in the early years. "
    "Ships from the northern ports brought timber, and the timber built the first warehouses "
    "along the water. When the railway arrived, the warehouses were joined by a station and a "
    "row of hotels for travellers waiting on the tides. A storm in the winter of the great flood "
    "broke the new pier in two, and for a whole season the merchants had to share the old quay "
    "with the fishermen again. The town council then paid for a breakwater of granite blocks. "
)


def prompt_of(llm) -> list[int]:
    text = PASSAGE * 5 + "Question: what broke the new pier? Answer in one sentence."
    prompt = llm.tokenize(text)
    assert 450 < len(prompt) < 700, len(prompt)
    # 16k + 1 tokens: a hit on every whole block leaves the last prompt token alone.
    return prompt[: (len(prompt) - 1) // 16 * 16 + 1]


def test_a_prefix_hit_of_any_length_gives_the_cold_prompts_bits(llm) -> None:
    core = llm.engine
    prompt = prompt_of(llm)
    cold = answer(core, "cold", prompt, "cold")
    assert cold[2] == 0
    # Hits inside a query block and at one's start, of one block, and of all but one or two
    # tokens (the last prompt token then runs alone, as a prompt chunk).
    for cached in (17, 256, 300, 400, len(prompt) - 2, len(prompt) - 1):
        salt = f"hit-{cached}"
        answer(core, f"first-{cached}", prompt[:cached], salt, SamplingParams(max_tokens=1))
        tokens, logprobs, num_cached = answer(core, f"hit-{cached}", prompt, salt)
        assert num_cached == min(cached, len(prompt) - 1) // 16 * 16 > 0
        assert (tokens, logprobs) == cold[:2], cached  # equal floats


@pytest.mark.parametrize("on_its_thread", [True, False])
def test_a_prompt_chunked_beside_a_decoding_stream_gives_its_cold_bits(
    llm, monkeypatch, on_its_thread
) -> None:
    """While another request decodes, a prompt computes all but its last token in a chunk on a
    thread of its own (prefill_beside_decode), or, without, takes at most
    max_prefill_tokens_while_decoding tokens a step (64): either way its chunks are cut at other
    places than a prompt alone is."""
    core = llm.engine
    if not on_its_thread:
        monkeypatch.setattr(core, "beside", None)
    prompt = prompt_of(llm)
    cold = answer(core, "alone", prompt, "alone")
    stream = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    salt = f"stream-{on_its_thread}"
    core.add_request("stream", llm.tokenize("Tell me a story."), stream, cache_salt=salt)
    core.step()
    core.step()
    chunks = core.stats().step_seconds.get("prefill_beside")
    before = 0 if chunks is None else chunks.num
    assert answer(core, "chunked", prompt, f"chunked-{on_its_thread}")[:2] == cold[:2]
    chunks = core.stats().step_seconds.get("prefill_beside")
    assert (chunks is not None and chunks.num == before + 1) == on_its_thread
    run_to_completion(core)


class CountingDecoder:
    """The runner's fused decoder, counting the steps it runs."""

    def __init__(self, inner) -> None:
        self.inner, self.max_rows, self.calls = inner, inner.max_rows, 0

    def __call__(self, *args):
        self.calls += 1
        return self.inner(*args)


def test_a_prompts_lone_last_token_runs_as_a_prompt_chunk(llm, monkeypatch) -> None:
    """A hit on every whole block of a 16k + 1-token prompt leaves its last token alone: it runs
    on the prompt path (as the whole prompt computes it), not as a decode row of the fused step;
    the answer's later tokens are decode rows, one a step."""
    core = llm.engine
    prompt = prompt_of(llm)
    answer(core, "first", prompt[:-1], "lone", SamplingParams(max_tokens=1))
    counting = CountingDecoder(core.runner.fused_decoder)
    monkeypatch.setattr(core.runner, "fused_decoder", counting)
    one_at_a_time = SamplingParams(max_tokens=6, temperature=0, speculative=False)
    tokens, _, num_cached = answer(core, "lone", prompt, "lone", one_at_a_time)
    assert num_cached == len(prompt) - 1
    assert counting.calls == len(tokens) - 1
