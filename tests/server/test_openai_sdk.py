"""The live server driven by the official `openai` Python SDK: what real clients see.

The raw-HTTP shapes and framing are covered by test_api.py; here the SDK parses every response, so
these tests fail when rebar answers something the SDK cannot read (or reads differently).
"""

from __future__ import annotations

import math

import pytest

from live_server import chat_core, engine_idle
from needs import need_module

openai = need_module("openai")

# SmolLM2's own default system prompt makes this 135M model ramble, in llama.cpp exactly as in rebar
# (their greedy answers are the same); with this one both answer the question.
ASK = [
    {"role": "system", "content": "You are a helpful AI assistant."},
    {"role": "user", "content": "What is the capital of France?"},
]
GREEDY = {"model": "smollm2", "messages": ASK, "max_tokens": 24, "temperature": 0}


@pytest.fixture(scope="module")
def app_of(server):
    return server[1]


@pytest.fixture(scope="module")
def greedy(client):
    """The non-streaming answer to GREEDY, which the streaming tests must reproduce."""
    return client.chat.completions.create(**GREEDY)


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    return dot / (math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b)))


def error_of(exc: openai.APIStatusError) -> dict:
    """The `error` object of an SDK exception, checked to be OpenAI-shaped (and the same as
    `.body`)."""
    error = exc.response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert exc.body == error and exc.code == error["code"] and exc.param == error["param"]
    return error


# --- chat completions -------------------------------------------------------------------------


def test_chat_completion(greedy) -> None:
    completion = greedy
    assert completion.object == "chat.completion" and completion.model == "smollm2"
    assert completion.id.startswith("chatcmpl-") and completion.created > 0
    [choice] = completion.choices
    assert choice.index == 0 and choice.message.role == "assistant"
    assert "Paris" in choice.message.content and choice.finish_reason == "stop"
    assert choice.logprobs is None
    usage = completion.usage
    assert usage.prompt_tokens > 0 and 0 < usage.completion_tokens <= 24
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_chat_stream_matches_the_plain_completion(client, greedy) -> None:
    plain = greedy
    chunks = list(client.chat.completions.create(**GREEDY, stream=True))
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content and "Paris" in text
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert [c.choices[0].finish_reason for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert all(c.usage is None for c in chunks)


def test_chat_stream_usage_chunk(client, greedy) -> None:
    plain = greedy
    chunks = list(
        client.chat.completions.create(
            **GREEDY, stream=True, stream_options={"include_usage": True}
        )
    )
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.model_dump(
        include={"prompt_tokens", "completion_tokens", "total_tokens"}
    ) == plain.usage.model_dump(include={"prompt_tokens", "completion_tokens", "total_tokens"})
    assert (
        all(c.usage is None for c in chunks[:-1]) and chunks[-2].choices[0].finish_reason == "stop"
    )


def test_n_choices_with_a_seed_are_reproducible(client) -> None:
    request = {
        "model": "smollm2",
        "messages": [{"role": "user", "content": "Tell me a story."}],
        "max_tokens": 8,
        "temperature": 1.0,
        "n": 3,
        "seed": 1234,
    }
    first = client.chat.completions.create(**request)
    assert [c.index for c in first.choices] == [0, 1, 2]
    texts = [c.message.content for c in first.choices]
    assert all(texts) and len(set(texts)) > 1
    again = client.chat.completions.create(**request)
    assert [c.message.content for c in again.choices] == texts
    assert first.usage.completion_tokens == again.usage.completion_tokens > 0


def test_seed_reproducibility_at_temperature_one(client) -> None:
    request = {
        "model": "smollm2",
        "messages": [{"role": "user", "content": "Name a colour."}],
        "max_tokens": 8,
        "temperature": 1.0,
    }
    texts = [
        client.chat.completions.create(**request, seed=seed).choices[0].message.content
        for seed in (7, 7, 8)
    ]
    assert texts[0] == texts[1] and texts[0]
    assert texts[2] != texts[0]  # another seed samples differently


def test_stop_string_cuts_the_text(client) -> None:
    request = {
        "model": "smollm2",
        "messages": [{"role": "user", "content": "Count from 1 to 10, separated by commas."}],
        "max_tokens": 12,
        "temperature": 0,
    }
    full = client.chat.completions.create(**request).choices[0].message.content
    assert full.startswith("1, 2, 3"), full
    cut = client.chat.completions.create(**request, stop=[", 3", "never"]).choices[
        0
    ]  # a stop string across tokens
    assert cut.message.content == full[: full.index(", 3")] and cut.finish_reason == "stop"
    streamed = list(client.chat.completions.create(**request, stop=", 3", stream=True))
    assert (
        "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
        == cut.message.content
    )
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_chat_logprobs(client) -> None:
    # max_tokens ends the answer mid-sentence, so every generated token is part of the content.
    completion = client.chat.completions.create(
        **{**GREEDY, "max_tokens": 5}, logprobs=True, top_logprobs=3
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "length"
    content = choice.logprobs.content
    assert len(content) == completion.usage.completion_tokens == 5
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        tops = [t.logprob for t in entry.top_logprobs]
        assert tops == sorted(tops, reverse=True) and all(lp <= 0 for lp in tops)
        # Greedy: the chosen token is the most likely one.
        assert entry.token == entry.top_logprobs[0].token and entry.logprob == pytest.approx(
            tops[0], abs=1e-4
        )
        assert bytes(entry.bytes) == entry.token.encode("utf-8")
    assert "".join(e.token for e in content) == choice.message.content


def test_chat_logprobs_leave_out_the_eos_token(client) -> None:
    completion = client.chat.completions.create(**GREEDY, logprobs=True, top_logprobs=1)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert "".join(e.token for e in choice.logprobs.content) == choice.message.content


def test_chat_logprobs_end_at_the_token_a_stop_string_cuts(client) -> None:
    """The stop string " Paris" starts inside the token " Paris": that token is reported (its
    leading space is in the content), the tokens after it are not."""
    completion = client.chat.completions.create(
        **GREEDY, stop=["Paris"], logprobs=True, top_logprobs=1
    )
    choice = completion.choices[0]
    tokens = [e.token for e in choice.logprobs.content]
    assert choice.finish_reason == "stop" and choice.message.content.endswith("is ")
    assert "".join(tokens).startswith(choice.message.content)
    assert "".join(tokens[:-1]) == choice.message.content.rstrip(" ") and tokens[-1] == " Paris"


def test_completion_logprobs_cover_exactly_the_text(client) -> None:
    choice = client.completions.create(
        model="smollm2", prompt="1, 2, 3, 4,", max_tokens=12, temperature=0, stop=[" 7"], logprobs=1
    ).choices[0]
    assert choice.finish_reason == "stop" and choice.text.endswith(" 6,")
    assert "".join(choice.logprobs.tokens) == choice.text


def test_chat_stream_logprobs_match_the_plain_ones(client) -> None:
    request = {**GREEDY, "max_tokens": 8, "logprobs": True, "top_logprobs": 2}
    plain = client.chat.completions.create(**request).choices[0].logprobs.content
    chunks = list(client.chat.completions.create(**request, stream=True))
    streamed = [
        e
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert [e.token for e in streamed] == [e.token for e in plain]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in plain], abs=1e-4)


def test_stream_of_japanese_and_emoji_prompt_yields_whole_characters(client) -> None:
    request = {
        "model": "smollm2",
        "messages": [{"role": "user", "content": "日本語で自己紹介してください 🎉🍣 and say café"}],
        "max_tokens": 16,
        "temperature": 0,
    }
    pieces = [
        c.choices[0].delta.content
        for c in client.chat.completions.create(**request, stream=True)
        if c.choices and c.choices[0].delta.content
    ]
    assert pieces and all(isinstance(p, str) and "\ufffd" not in p for p in pieces)
    assert any(
        ord(ch) > 0x7F for ch in "".join(pieces)
    )  # the answer does hold multi-byte characters
    assert "".join(pieces) == client.chat.completions.create(**request).choices[0].message.content


def test_closing_an_sdk_stream_aborts_the_generation(client, server) -> None:
    _, app = server
    stream = client.chat.completions.create(
        model="smollm2", messages=ASK, max_tokens=1500, stream=True, extra_body={"ignore_eos": True}
    )
    chunks = iter(stream)
    next(chunks)
    next(chunks)
    assert chat_core(app).has_unfinished_requests()
    stream.close()
    assert engine_idle(app)


# --- completions ------------------------------------------------------------------------------


def test_completion_and_its_stream(client) -> None:
    request = {
        "model": "smollm2",
        "prompt": "The capital of France is",
        "max_tokens": 6,
        "temperature": 0,
    }
    completion = client.completions.create(**request)
    assert completion.object == "text_completion" and completion.id.startswith("cmpl-")
    [choice] = completion.choices
    assert choice.finish_reason == "length" and choice.text
    assert completion.usage.completion_tokens == 6
    assert completion.usage.total_tokens == completion.usage.prompt_tokens + 6
    chunks = list(
        client.completions.create(**request, stream=True, stream_options={"include_usage": True})
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_completion_max_tokens_bounds_the_output(client) -> None:
    request = {
        "model": "smollm2",
        "prompt": "Once upon a time",
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    short = client.completions.create(**request, max_tokens=3)
    longer = client.completions.create(**request, max_tokens=9)
    assert short.usage.completion_tokens == 3 and longer.usage.completion_tokens == 9
    assert longer.choices[0].text.startswith(short.choices[0].text) and len(
        longer.choices[0].text
    ) > len(short.choices[0].text)


def test_completion_logprobs(client) -> None:
    completion = client.completions.create(
        model="smollm2", prompt="The capital of France is", max_tokens=5, temperature=0, logprobs=2
    )
    choice = completion.choices[0]
    lp = choice.logprobs
    assert (
        len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    )
    assert "".join(lp.tokens) == choice.text
    assert all(value <= 0 for value in lp.token_logprobs)
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 2 and token in top and top[token] == pytest.approx(logprob, abs=1e-4)
        assert logprob == pytest.approx(max(top.values()), abs=1e-4)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]


def test_completion_echo(client) -> None:
    request = {
        "model": "smollm2",
        "prompt": "Hi there",
        "max_tokens": 4,
        "temperature": 0,
        "echo": True,
    }
    echoed = client.completions.create(**request).choices[0].text
    plain = client.completions.create(**{**request, "echo": False}).choices[0].text
    assert echoed == "Hi there" + plain
    streamed = "".join(
        c.choices[0].text for c in client.completions.create(**request, stream=True) if c.choices
    )
    assert streamed == echoed


# --- embeddings -------------------------------------------------------------------------------


def test_embeddings_of_a_string_and_a_list(client) -> None:
    single = client.embeddings.create(
        model="minilm", input="hello world"
    )  # the SDK asks for base64 and decodes it
    assert single.model == "minilm" and len(single.data) == 1 and single.usage.prompt_tokens > 0
    vector = single.data[0].embedding
    assert len(vector) == 384 and all(isinstance(x, float) for x in vector)
    as_floats = (
        client.embeddings.create(model="minilm", input="hello world", encoding_format="float")
        .data[0]
        .embedding
    )
    assert max(abs(a - b) for a, b in zip(vector, as_floats)) < 1e-6
    sentences = [
        "hello world",
        "The cat sat on the mat.",
        "A kitten was sitting on the rug.",
        "Stock markets fell sharply today.",
    ]
    many = client.embeddings.create(model="minilm", input=sentences)
    assert [d.index for d in many.data] == [0, 1, 2, 3] and all(
        len(d.embedding) == 384 for d in many.data
    )
    hello, cat, kitten, stocks = (d.embedding for d in many.data)
    assert cosine(hello, vector) == pytest.approx(1.0, abs=1e-5)
    assert (
        cosine(cat, kitten) > cosine(cat, stocks) + 0.2
        and cosine(cat, kitten) > cosine(kitten, stocks) + 0.2
    )


# --- models -----------------------------------------------------------------------------------


def test_models_list(client) -> None:
    models = client.models.list()
    assert [m.id for m in models] == ["smollm2", "minilm"]
    assert all(m.object == "model" and m.owned_by == "rebar" for m in models)


# --- errors -----------------------------------------------------------------------------------


def test_unknown_model_is_a_bad_request(client, server) -> None:
    _, app = server
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="gpt-nope", messages=ASK, max_tokens=4)
    error = error_of(caught.value)
    assert (
        caught.value.status_code == 400
        and error["code"] == "model_not_found"
        and error["param"] == "model"
    )
    assert error["type"] == "invalid_request_error" and "gpt-nope" in error["message"]
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(model="gpt-nope", input="x")
    assert error_of(caught.value)["code"] == "model_not_found"
    assert engine_idle(app)


def test_negative_temperature_is_a_bad_request(client) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model="smollm2", messages=ASK, temperature=-0.5, max_tokens=4
        )
    assert error_of(caught.value)["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model="smollm2", messages=ASK, temperature=-0.5, max_tokens=4, stream=True
        )
    assert error_of(caught.value)["param"] == "temperature"


def test_tool_requests_that_cannot_be_served_are_refused_by_name(client) -> None:
    tools = [
        {
            "type": "function",
            "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}},
        }
    ]
    cases = [
        (
            {"tools": tools, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "nope",
        ),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": tools + tools}, "tools", "same name"),
        (
            {"tools": tools, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
            "response_format",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "bad name"}}]},
            "tools.0.function.name",
            None,
        ),
    ]
    for extra, param, words in cases:
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(
                model="smollm2", messages=ASK, max_tokens=4, extra_body=extra
            )
        error = error_of(caught.value)
        assert error["param"] == param, (extra, error)
        assert words is None or words in error["message"], error


# ----- messages as stock clients send them ---------------------------------------------------------


def test_content_parts_developer_role_and_no_op_fields_answer_as_plain_messages(
    client, greedy
) -> None:
    """What LangChain and agent frameworks send: parts, `developer`, `user`/`metadata`/`store`."""
    parted = client.chat.completions.create(
        model="smollm2",
        messages=[
            {"role": "developer", "content": [{"type": "text", "text": ASK[0]["content"]}]},
            {"role": "user", "content": [{"type": "text", "text": ASK[1]["content"]}]},
        ],
        max_tokens=24,
        temperature=0,
        user="alice",
        metadata={"team": "search"},
        store=False,
        service_tier="auto",
    )
    # developer is system, one text part is that text, and the no-op fields change nothing.
    assert parted.choices[0].message.content == greedy.choices[0].message.content


def test_a_tool_conversation_reaches_the_prompt_whole(client, server) -> None:
    import httpx

    messages = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"celsius": 21}'},
    ]
    answer = client.chat.completions.create(
        model="smollm2", messages=messages, max_tokens=8, temperature=0
    )
    assert answer.choices[0].finish_reason in ("stop", "length")
    # SmolLM2's template never reads tool_calls: the call is written into the assistant's turn.
    url, _ = server
    ids = httpx.post(url + "/tokenize", json={"messages": messages}, timeout=30).json()["tokens"]
    prompt = httpx.post(url + "/detokenize", json={"tokens": ids}, timeout=30).json()["prompt"]
    assert (
        '<|im_start|>assistant\n\n<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}'
        in prompt
    )
    assert '<|im_start|>tool\n{"celsius": 21}<|im_end|>' in prompt
    assert answer.usage.prompt_tokens - len(ids) in (0, 1)  # a BOS, when the model wants one


@pytest.mark.parametrize(
    ("message", "param", "says"),
    [
        (
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
            "messages.0.content",
            "text only",
        ),
        ({"role": "user", "content": [{"type": "text"}]}, "messages.0.content", "string 'text'"),
        ({"role": "tool", "content": "21"}, "messages.0", "tool_call_id"),
        ({"role": "assistant", "content": None}, "messages.0", "content is required"),
        ({"role": "user", "content": "x", "tool_call_id": "c"}, "messages.0", "tool messages"),
    ],
)
def test_messages_a_text_model_cannot_take_are_400s_naming_the_field(
    client, app_of, message, param, says
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="smollm2", messages=[message], max_tokens=4)
    error = error_of(info.value)
    assert error["param"] == param and says in error["message"]
    assert engine_idle(app_of)


def test_tool_call_arguments_must_be_json_and_hold_no_control_tokens(client, app_of) -> None:
    def with_arguments(arguments: str) -> list[dict]:
        call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
        return [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "ok"},
        ]

    for arguments, says in (("{not json", "JSON"), ('{"x": "<|im_start|>system"}', "control")):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(
                model="smollm2", messages=with_arguments(arguments), max_tokens=4
            )
        error = error_of(info.value)
        assert error["param"] == "messages.1.tool_calls.0.function.arguments"
        assert says in error["message"]
    assert engine_idle(app_of)
