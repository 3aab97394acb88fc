"""Anthropic message bodies and stream events from neutral results, without a model: a thinking
model's reasoning as `thinking` blocks, tool calls as `tool_use` blocks, stop reasons, an empty
answer, keep-alives and a generation that fails mid-stream; the stream read back by the official
SDK's own accumulator."""

from __future__ import annotations

import json

import pytest

from needs import need_module
from rebar.server.dialects.anthropic_messages.render import MessagesRenderer
from rebar.server.pipeline.respond import ResponseInfo
from rebar.server.pipeline.results import (
    PING,
    Answer,
    AnswerChoice,
    ChoiceEnd,
    Delta,
    StreamEnd,
    ToolCall,
    ToolCallDelta,
    Usage,
)

anthropic = need_module("anthropic")

INFO = ResponseInfo("abc", "smollm2", "smollm2-v1", 0, 1, False, True, num_prompt_tokens=12)
USAGE = Usage(prompt_tokens=12, completion_tokens=7, cached_tokens=5)


def rendered(items) -> list[str]:
    render = MessagesRenderer(INFO)
    texts = [*render.stream_start()]
    for item in items:
        texts += render.stream_item(item)
    return [*texts, *render.stream_end()]


def events(items) -> list[dict]:
    parsed = []
    for text in rendered(items):
        name, data = text.strip().split("\n")
        assert name.startswith("event: ") and data.startswith("data: ")
        payload = json.loads(data[6:])
        assert payload["type"] == name[7:]  # the event's name is its type
        parsed.append(payload)
    return parsed


def accumulated(items):
    """The final message as the official SDK reads it from the stream."""
    import httpx2 as httpx

    body = "".join(rendered(items)).encode()

    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})

    http = httpx.Client(transport=httpx.MockTransport(answer))
    client = anthropic.Anthropic(base_url="http://rebar", api_key="k", http_client=http)
    with client.messages.stream(
        model="smollm2", max_tokens=8, messages=[{"role": "user", "content": "hi"}]
    ) as stream:
        return stream.get_final_message()


def test_a_whole_answer_has_thinking_text_and_tool_use_blocks() -> None:
    call = ToolCall("call_1", "get_weather", '{"city": "Paris"}')
    choice = AnswerChoice(0, "Let me check.", "The user wants weather.", (call,), "stop", None)
    body = MessagesRenderer(INFO).body(Answer((choice,), USAGE, None))
    assert body["content"] == [
        {"type": "thinking", "thinking": "The user wants weather.", "signature": ""},
        {"type": "text", "text": "Let me check."},
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
    ]
    assert body["stop_reason"] == "tool_use" and body["stop_sequence"] is None
    assert body["usage"] == {
        "input_tokens": 7,
        "output_tokens": 7,
        "cache_read_input_tokens": 5,
        "cache_creation_input_tokens": 0,
    }
    message = anthropic.types.Message.model_validate(body)
    assert message.content[2].input == {"city": "Paris"}


@pytest.mark.parametrize(
    ("finish", "stop", "reason"),
    [
        ("stop", None, "end_turn"),
        ("stop", "\n\n", "stop_sequence"),
        ("length", None, "max_tokens"),
        ("rate_limited", None, "max_tokens"),
    ],
)
def test_stop_reasons(finish: str, stop: str | None, reason: str) -> None:
    choice = AnswerChoice(0, "Hi", None, (), finish, None, stop_sequence=stop)
    body = MessagesRenderer(INFO).body(Answer((choice,), USAGE, None))
    assert body["stop_reason"] == reason and body["stop_sequence"] == stop
    streamed = events(
        [[Delta(0, "Hi"), ChoiceEnd(0, finish, stop_sequence=stop)], StreamEnd(USAGE, None)]
    )
    assert streamed[-2]["delta"] == {"stop_reason": reason, "stop_sequence": stop}


def test_a_stream_of_thinking_text_and_a_call_in_anthropics_order() -> None:
    items = [
        PING,
        [Delta(0, "", "Hmm.")],
        [Delta(0, "", " Weather."), Delta(0, "Checking.")],
        [
            ToolCallDelta(0, 0, "call_9", "get_weather"),
            ToolCallDelta(0, 0, arguments='{"city"'),
        ],
        [ToolCallDelta(0, 0, arguments=': "Oslo"}'), ChoiceEnd(0, "stop", has_tool_calls=True)],
        StreamEnd(USAGE, None),
    ]
    payloads = events(items)
    kinds = [p["type"] for p in payloads]
    assert kinds == [
        "message_start",
        "ping",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert payloads[0]["message"]["usage"]["input_tokens"] == 12
    starts = [p for p in payloads if p["type"] == "content_block_start"]
    assert [s["index"] for s in starts] == [0, 1, 2]
    final = accumulated(items)
    assert [b.type for b in final.content] == ["thinking", "text", "tool_use"]
    assert final.content[0].thinking == "Hmm. Weather." and final.content[1].text == "Checking."
    assert final.content[2].input == {"city": "Oslo"} and final.content[2].id == "toolu_9"
    assert final.stop_reason == "tool_use"
    assert final.usage.input_tokens == 7 and final.usage.cache_read_input_tokens == 5


def test_an_empty_answer_streams_one_empty_text_block() -> None:
    items = [[ChoiceEnd(0, "stop")], StreamEnd(Usage(12, 1, 0), None)]
    payloads = events(items)
    assert [p["type"] for p in payloads] == [
        "message_start",
        "content_block_start",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert accumulated(items).content[0].text == ""


@pytest.mark.parametrize(("finish", "kind"), [("timeout", "timeout_error"), ("error", "api_error")])
def test_a_generation_that_fails_mid_stream_ends_with_an_error_event(
    finish: str, kind: str
) -> None:
    payloads = events(
        [[Delta(0, "Par")], [ChoiceEnd(0, finish, error="it broke")], StreamEnd(USAGE, None)]
    )
    assert payloads[-1] == {"type": "error", "error": {"type": kind, "message": "it broke"}}
    assert "message_stop" not in [p["type"] for p in payloads]


def test_a_stream_that_produced_nothing_ends_with_an_error_event() -> None:
    payloads = events([])
    assert [p["type"] for p in payloads] == ["message_start", "error"]
    assert payloads[-1]["error"]["type"] == "api_error"
