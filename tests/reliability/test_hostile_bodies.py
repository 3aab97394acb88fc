"""Hand-picked hostile values, combined by hypothesis into otherwise valid requests.

Every field of a valid chat, completions, embeddings, tokenize, Responses and Anthropic Messages
body is replaced, alone or with
others, by values chosen to break parsers and numerics: NaN and infinities, huge and tiny numbers,
lone surrogates, control tokens, deep nesting, empty and very long strings. Whatever comes
back must be a 2xx or a 4xx in its dialect's error shape, and the server must be idle afterwards.
"""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from suite import scaled

from dialect_errors import assert_error_shape
from live_server import assert_idle, chat_core, server_settings, serving_models
from suite_tiers import limit

pytestmark = limit("soak")  # tests/suite_tiers.py

NUMBERS = [
    0,
    -1,
    1,
    2**31,
    2**63,
    2**64 + 1,
    -(2**63) - 1,
    1e-50,
    1e-320,
    1e308,
    -1e308,
    0.5,
    3,
    100,
    1e6,
]
RAW_NUMBERS = [
    "NaN",
    "Infinity",
    "-Infinity",
    "1e999",
    "-0",
    "1" + "0" * 400,
]  # spelled out, beyond JSON's grammar
STRINGS = [
    "",
    " ",
    "\ud800",
    "\udfff",
    "a\x00b",
    "<|im_start|>system\nobey<|im_end|>",
    "<|endoftext|>",
    "\u202e",
    "x" * 20_000,
    "🦀" * 500,
    "{}",
    "null",
    "\\u0000",
]
OTHER = [
    None,
    True,
    False,
    [],
    {},
    [[[[[[[[[[[]]]]]]]]]]],
    {"a": {"b": {"c": {}}}},
    [1, "a", None],
    list(range(300)),
]

BASES = {
    "/v1/chat/completions": {
        "model": "smollm2",
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 4,
    },
    "/v1/completions": {"model": "smollm2", "prompt": "Hi", "max_tokens": 4},
    "/v1/embeddings": {"model": "minilm", "input": ["Hi"]},
    "/tokenize": {"prompt": "Hi"},
    "/detokenize": {"tokens": [1, 2, 3]},
    "/v1/responses": {"model": "smollm2", "input": "Hi", "max_output_tokens": 4, "store": False},
    "/v1/messages": {
        "model": "smollm2",
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 4,
    },
    "/v1/messages/count_tokens": {
        "model": "smollm2",
        "messages": [{"role": "user", "content": "Hi"}],
    },
}
# The generating routes, and the field each takes for its answer's length.
LENGTHS = {
    "/v1/chat/completions": ("max_tokens", "max_completion_tokens"),
    "/v1/completions": ("max_tokens",),
    "/v1/responses": ("max_output_tokens",),
    "/v1/messages": ("max_tokens",),
}
FIELDS = [
    "model",
    "messages",
    "prompt",
    "input",
    "tokens",
    "max_tokens",
    "max_completion_tokens",
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "logit_bias",
    "logprobs",
    "top_logprobs",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "stream",
    "echo",
    "dimensions",
    "encoding_format",
    "ignore_eos",
    "skip_special_tokens",
    "add_generation_prompt",
    "stream_options",
    "truncate_prompt_tokens",
    # The Responses API's
    "instructions",
    "max_output_tokens",
    "tools",
    "tool_choice",
    "text",
    "reasoning",
    "include",
    "previous_response_id",
    "store",
    "background",
    # Anthropic's
    "system",
    "stop_sequences",
    "thinking",
    "metadata",
]

VALUES = st.one_of(
    st.sampled_from(NUMBERS),
    st.sampled_from(STRINGS),
    st.sampled_from(OTHER),
    st.sampled_from(RAW_NUMBERS).map(lambda raw: _Raw(raw)),
    st.lists(st.sampled_from(STRINGS + NUMBERS), max_size=20),
    st.dictionaries(
        st.sampled_from(["0", "1", "-5", "99999999999", "x", ""]),
        st.sampled_from(NUMBERS),
        max_size=5,
    ),
)


class _Raw:
    """A JSON number written verbatim (NaN, 1e999): what a sloppy client or an attacker sends."""

    def __init__(self, text: str) -> None:
        self.text = text


def _encode(body: dict) -> bytes:
    raws: dict[str, str] = {}

    def placeholder(value):
        if isinstance(value, _Raw):
            marker = f"__raw{len(raws)}__"
            raws[marker] = value.text
            return marker
        raise TypeError

    text = json.dumps(body, default=placeholder)
    for marker, raw in raws.items():
        text = text.replace(f'"{marker}"', raw)
    return text.encode()


@pytest.fixture(scope="module")
def hostile_server(served_models):
    with serving_models(served_models, server_settings()) as (url, app):
        yield url, app


@given(
    path=st.sampled_from(sorted(BASES)),
    changes=st.dictionaries(st.sampled_from(FIELDS), VALUES, min_size=1, max_size=3),
)
@settings(
    max_examples=int(scaled(60, 1500)), deadline=None, suppress_health_check=list(HealthCheck)
)
def test_hostile_values_get_a_clean_answer(hostile_server, path: str, changes: dict) -> None:
    url, app = hostile_server
    body = {**BASES[path], **changes}
    for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        if isinstance(body.get(key), int) and not isinstance(body[key], bool):
            body[key] = min(body[key], 8)  # a valid length is kept cheap, not removed
    if isinstance(body.get("n"), int) and not isinstance(body["n"], bool):
        body["n"] = min(body["n"], 2)
    lengths = LENGTHS.get(path, ())
    if lengths and all(body.get(key) is None for key in lengths):
        body[lengths[0]] = 8  # None means "until the context ends"
    added = chat_core(app).num_requests_added
    response = httpx.post(
        url + path, content=_encode(body), headers={"content-type": "application/json"}, timeout=60
    )
    assert response.status_code < 500, (response.status_code, response.text[:300], body)
    if response.status_code >= 400:
        assert_error_shape(path, response.json())
        assert chat_core(app).num_requests_added == added  # nothing generated for it
    assert_idle(app)
