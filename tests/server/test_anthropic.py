"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`) driven by the official
`anthropic` SDK, as Claude Code and Anthropic's clients drive it, against a live server with API
keys on (the SDK sends its key as `x-api-key`): whole and streamed answers equal to the chat
route's greedy answer token for token, stop sequences, tool use and tool results, token counts,
and errors in Anthropic's shape with its status codes."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from live_server import assert_idle, server_settings, serving_models
from needs import need_module

anthropic = need_module("anthropic")
openai = need_module("openai")
jsonschema = need_module("jsonschema")

KEY = "sk-messages-test"
# The SDK no longer has sampling arguments (Anthropic's newest models take none); older clients
# and other tools still send them, and rebar takes them.
GREEDY = {"temperature": 0}
SYSTEM = "You are a helpful AI assistant."
QUESTION = "What is the capital of France?"
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}


@pytest.fixture(scope="module")
def server(served_models):
    settings = server_settings(**{"server.api_keys": [KEY]})
    with serving_models(served_models, settings) as (url, app):
        yield url, app


@pytest.fixture(scope="module")
def client(server):
    url, _ = server
    with anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0, timeout=300) as sdk:
        yield sdk


@pytest.fixture(scope="module")
def chat_answer(server) -> str:
    """The chat route's greedy answer to the same question, which /v1/messages must repeat."""
    url, _ = server
    with openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=300) as sdk:
        reply = sdk.chat.completions.create(
            model="smollm2",
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}],
            max_tokens=24,
            temperature=0,
        )
    return reply.choices[0].message.content


def ask(client, **extra):
    fields = {
        "model": "smollm2",
        "system": SYSTEM,
        "messages": [{"role": "user", "content": QUESTION}],
        "max_tokens": 24,
        "extra_body": GREEDY,
        **extra,
    }
    return client.messages.create(**fields)


def test_a_message_says_what_chat_says(client, chat_answer) -> None:
    message = ask(client)
    assert message.id.startswith("msg_") and message.type == "message"
    assert message.role == "assistant" and message.model == "smollm2"
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == chat_answer
    assert message.stop_reason in ("end_turn", "max_tokens") and message.stop_sequence is None
    usage = message.usage
    assert 0 < usage.output_tokens <= 24
    assert usage.input_tokens + usage.cache_read_input_tokens > 10


def test_thinking_metadata_and_cache_marks_are_taken_and_change_no_token(
    client, chat_answer
) -> None:
    message = ask(
        client,
        max_tokens=1200,
        thinking={"type": "enabled", "budget_tokens": 1024},
        metadata={"user_id": "u-1"},
        cache_control={"type": "ephemeral"},
        extra_body={"temperature": 0, "top_k": 1, "top_p": 0.9},
    )
    # SmolLM2 does not think: no thinking block, and the greedy answer as chat wrote it.
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text.startswith(chat_answer)


def test_system_as_text_blocks_with_cache_marks_reads_the_same(client, chat_answer) -> None:
    system = [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}]
    content = [{"type": "text", "text": QUESTION, "cache_control": {"type": "ephemeral"}}]
    message = ask(client, system=system, messages=[{"role": "user", "content": content}])
    assert message.content[0].text == chat_answer


def test_count_tokens_counts_the_prompt_a_message_reads(client) -> None:
    counted = client.messages.count_tokens(
        model="smollm2", system=SYSTEM, messages=[{"role": "user", "content": QUESTION}]
    )
    usage = ask(client, max_tokens=2).usage
    assert counted.input_tokens == usage.input_tokens + usage.cache_read_input_tokens
    with_tools = client.messages.count_tokens(
        model="smollm2",
        system=SYSTEM,
        messages=[{"role": "user", "content": QUESTION}],
        tools=[WEATHER],
    )
    assert with_tools.input_tokens > counted.input_tokens + 20  # the tool's schema is in the prompt


def test_the_token_limit_stops_with_max_tokens(client) -> None:
    message = ask(client, max_tokens=3, messages=[{"role": "user", "content": "Tell a story."}])
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 3


def test_a_stop_sequence_ends_the_message_and_is_named(client, chat_answer) -> None:
    stop = " " + chat_answer.split()[2]
    message = ask(client, stop_sequences=[stop, "never-written"])
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert message.content[0].text == chat_answer[: chat_answer.index(stop)]


def test_a_stream_sends_anthropics_events_in_order(client, chat_answer) -> None:
    with client.messages.stream(
        model="smollm2",
        system=SYSTEM,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=24,
        extra_body=GREEDY,
    ) as stream:
        events = list(stream)
        final = stream.get_final_message()
    raw = [e for e in events if e.type not in ("text",)]  # the SDK's own text events aside
    kinds = [e.type for e in raw]
    assert kinds[0] == "message_start" and kinds[1] == "content_block_start"
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    deltas = [e.delta for e in raw if e.type == "content_block_delta"]
    assert {d.type for d in deltas} == {"text_delta"}
    assert "".join(d.text for d in deltas) == chat_answer
    assert final.content[0].text == chat_answer
    assert final.stop_reason in ("end_turn", "max_tokens") and final.usage.output_tokens > 0


def test_pings_keep_a_slow_stream_alive(server) -> None:
    url, app = server
    state = app.state.rebar
    state.ping_interval_s = 0.005
    body = {
        "model": "smollm2",
        "messages": [{"role": "user", "content": QUESTION}],
        "max_tokens": 8,
        "stream": True,
    }
    try:
        response = httpx.post(
            url + "/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=60
        )
    finally:
        state.ping_interval_s = 10.0
    names = [line[7:] for line in response.text.splitlines() if line.startswith("event: ")]
    assert "ping" in names and names[0] == "message_start" and names[-1] == "message_stop"
    assert 'data: {"type": "ping"}' in response.text


def test_a_forced_tool_use_and_its_result_round_trip(client) -> None:
    question = {"role": "user", "content": "What is the weather in Paris?"}
    message = client.messages.create(
        model="smollm2",
        messages=[question],
        tools=[WEATHER],
        # One call: with parallel calls allowed this small model keeps writing more of them.
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        max_tokens=60,
        extra_body=GREEDY,
    )
    assert message.stop_reason == "tool_use"
    uses = [block for block in message.content if block.type == "tool_use"]
    assert uses and uses[0].name == "get_weather" and uses[0].id.startswith("toolu_")
    jsonschema.validate(uses[0].input, WEATHER["input_schema"])
    for result in (
        "21 C and sunny",
        [{"type": "text", "text": "21 C"}, {"type": "text", "text": "sunny"}],
    ):
        answer = client.messages.create(
            model="smollm2",
            messages=[
                question,
                {"role": "assistant", "content": message.content},
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": uses[0].id, "content": result}
                    ],
                },
            ],
            tools=[WEATHER],
            max_tokens=24,
            extra_body=GREEDY,
        )
        assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use") and answer.content


def test_a_failed_tool_result_reaches_the_prompt_as_an_error(client) -> None:
    def counted(is_error: bool) -> int:
        result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "no such city"}
        call = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "X"}}
        return client.messages.count_tokens(
            model="smollm2",
            messages=[
                {"role": "user", "content": "Weather in X?"},
                {"role": "assistant", "content": [call]},
                {"role": "user", "content": [{**result, "is_error": is_error}]},
            ],
            tools=[WEATHER],
        ).input_tokens

    assert counted(True) > counted(False)


def test_a_named_tool_streams_its_input_in_json_deltas(client) -> None:
    with client.messages.stream(
        model="smollm2",
        messages=[{"role": "user", "content": "What is the weather in Oslo?"}],
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
        max_tokens=60,
        extra_body=GREEDY,
    ) as stream:
        events = list(stream)
        final = stream.get_final_message()
    starts = [e for e in events if e.type == "content_block_start"]
    assert [s.content_block.type for s in starts] == ["tool_use"]
    partial = "".join(
        e.delta.partial_json
        for e in events
        if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
    )
    assert json.loads(partial) == final.content[0].input
    jsonschema.validate(final.content[0].input, WEATHER["input_schema"])
    assert final.stop_reason == "tool_use"


def test_output_config_format_makes_the_text_follow_its_schema(client) -> None:
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
        "required": ["city", "country"],
    }
    message = client.messages.create(
        model="smollm2",
        messages=[{"role": "user", "content": "Name a European capital."}],
        max_tokens=60,
        output_config={"format": {"type": "json_schema", "schema": schema}, "effort": "low"},
        extra_body=GREEDY,
    )
    value = json.loads(message.content[0].text)
    jsonschema.validate(value, schema)
    assert set(value) == {"city", "country"}


def test_tool_choice_none_answers_in_text(client) -> None:
    message = ask(client, tools=[WEATHER], tool_choice={"type": "none"})
    assert [block.type for block in message.content] == ["text"]


def test_a_repeated_greedy_message_is_a_cache_hit_with_the_model_version(client) -> None:
    first = client.messages.with_raw_response.create(
        model="smollm2",
        messages=[{"role": "user", "content": "Name a colour."}],
        max_tokens=8,
        extra_body=GREEDY,
    )
    again = client.messages.with_raw_response.create(
        model="smollm2",
        messages=[{"role": "user", "content": "Name a colour."}],
        max_tokens=8,
        extra_body=GREEDY,
    )
    assert again.headers["x-cache"] == "HIT" and first.headers["x-cache"] in ("MISS", "HIT")
    assert again.headers["x-rebar-model-version"] == first.headers["x-rebar-model-version"]
    assert again.parse().content[0].text == first.parse().content[0].text


@pytest.mark.parametrize(
    ("body", "named"),
    [
        ({"messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
        ({"max_tokens": 8, "messages": []}, "messages"),
        ({"max_tokens": 8, "messages": [{"role": "system", "content": "x"}]}, "messages.0.role"),
        (
            {
                "max_tokens": 8,
                "frequency_penalty": 1,
                "messages": [{"role": "user", "content": "hi"}],
            },
            "frequency_penalty",
        ),
        (
            {
                "max_tokens": 8,
                "messages": [
                    {"role": "user", "content": [{"type": "image", "source": {"type": "url"}}]}
                ],
            },
            "messages.0.content.0",
        ),
        (
            {
                "max_tokens": 8,
                "messages": [{"role": "user", "content": "hi"}],
                "tools": [{"type": "web_search_20250305", "name": "web_search"}],
            },
            "tools.0",
        ),
        (
            {
                "max_tokens": 8,
                "messages": [{"role": "user", "content": "hi"}],
                "tools": [WEATHER],
                "tool_choice": {"type": "tool", "name": "nope"},
            },
            "tool_choice.name",
        ),
        (
            {
                "max_tokens": 8,
                "messages": [{"role": "user", "content": "hi"}],
                "tool_choice": {"type": "any"},
            },
            "tool_choice",
        ),
        (
            {
                "max_tokens": 2000,
                "messages": [{"role": "user", "content": "hi"}],
                "thinking": {"type": "enabled", "budget_tokens": 100},
            },
            "budget_tokens",
        ),
        ({"max_tokens": 0, "messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
        (
            {
                "max_tokens": 2000,
                "messages": [{"role": "user", "content": "hi"}],
                "thinking": {"type": "enabled", "budget_tokens": 1024, "display": "omitted"},
            },
            "display",
        ),
        (
            {"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], "speed": "fast"},
            "speed",
        ),
        (
            {
                "max_tokens": 8,
                "messages": [{"role": "user", "content": "hi"}],
                "output_config": {"format": {"type": "json_schema", "schema": False}},
            },
            "output_config",
        ),
    ],
)
def test_bad_requests_are_anthropic_shaped_400s(server, body, named) -> None:
    url, app = server
    response = httpx.post(
        url + "/v1/messages",
        json={"model": "smollm2", **body},
        headers={"x-api-key": KEY},
        timeout=60,
    )
    assert response.status_code == 400, response.text
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert named in error["error"]["message"], error
    assert_idle(app)


def test_the_sdk_reads_an_error_as_anthropic_sends_it(client) -> None:
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(
            model="smollm2",
            max_tokens=8,
            messages=[{"role": "user", "content": "hi"}],
            extra_body={"frequency_penalty": 1},
        )
    assert caught.value.status_code == 400
    assert caught.value.body["error"]["type"] == "invalid_request_error"
    assert "frequency_penalty" in caught.value.body["error"]["message"]


def test_keys_are_read_from_x_api_key_and_a_wrong_one_is_refused(server) -> None:
    url, _ = server
    wrong = anthropic.Anthropic(base_url=url, api_key="sk-wrong", max_retries=0)
    with wrong, pytest.raises(anthropic.AuthenticationError) as caught:
        wrong.messages.count_tokens(model="smollm2", messages=[{"role": "user", "content": "hi"}])
    assert caught.value.body["error"]["type"] == "authentication_error"
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}]}
    response = httpx.post(url + "/v1/messages/count_tokens", json=body, timeout=30)
    assert response.status_code == 401 and response.json()["type"] == "error"
    response = httpx.post(
        url + "/v1/messages/count_tokens",
        json=body,
        headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"},
        timeout=30,
    )
    assert response.status_code == 200 and response.json()["input_tokens"] > 0


def test_unknown_routes_and_models_answer_in_anthropics_shape(server) -> None:
    url, _ = server
    headers = {"x-api-key": KEY}
    response = httpx.get(url + "/v1/messages/batches", headers=headers, timeout=30)
    assert response.status_code in (404, 405) and response.json()["type"] == "error"
    body = {
        "model": "claude-nope",
        "max_tokens": 4,
        "messages": [{"role": "user", "content": "hi"}],
    }
    response = httpx.post(url + "/v1/messages", json=body, headers=headers, timeout=30)
    assert response.status_code in (400, 404)
    assert response.json()["error"]["type"] in ("invalid_request_error", "not_found_error")


def test_overload_is_a_529_overloaded_error(server) -> None:
    from rebar.server.pipeline.gate import WaitingRoom

    url, app = server
    state = app.state.rebar
    original = state.gate.waiting
    state.gate.waiting = WaitingRoom(max_requests=1, max_prompt_tokens=10**6, retry_after_s=2)
    body = {
        "model": "smollm2",
        "max_tokens": 64,
        "messages": [{"role": "user", "content": "Count to a hundred."}],
        "temperature": 1.0,
    }
    answers: list[httpx.Response] = []

    def call() -> None:
        answers.append(
            httpx.post(url + "/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=120)
        )

    threads = [threading.Thread(target=call) for _ in range(6)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
    finally:
        state.gate.waiting = original
    overloaded = [a for a in answers if a.status_code == 529]
    assert overloaded and any(a.status_code == 200 for a in answers)
    assert overloaded[0].json()["error"]["type"] == "overloaded_error"
    assert overloaded[0].headers["retry-after"] == "2"
    assert_idle(app)


def test_metrics_count_messages_by_route(server, client) -> None:
    url, _ = server
    ask(client, max_tokens=2)
    client.messages.count_tokens(model="smollm2", messages=[{"role": "user", "content": "hi"}])
    metrics = httpx.get(url + "/metrics", timeout=30).text
    for route in ("/v1/messages", "/v1/messages/count_tokens"):
        line = f'route="{route}"'
        assert any(line in row and 'status="200"' in row for row in metrics.splitlines()), route
