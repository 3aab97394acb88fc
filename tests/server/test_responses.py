"""The Responses API (`/v1/responses`) driven by the official `openai` SDK, as the Agents SDK and
Codex drive it: whole and streamed answers equal to the chat route's greedy answer token for
token, stored responses and their continuation, structured text, function calls and their
outputs, background runs and their cancel, and bad input as OpenAI-shaped 4xx."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from live_server import assert_idle
from needs import need_module

openai = need_module("openai")
jsonschema = need_module("jsonschema")

SYSTEM = "You are a helpful AI assistant."
QUESTION = "What is the capital of France?"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}


@pytest.fixture(scope="module")
def chat_answer(client) -> str:
    """The chat route's greedy answer to the same question, which every dialect must repeat."""
    reply = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}],
        max_tokens=24,
        temperature=0,
    )
    return reply.choices[0].message.content


def ask(client, **extra):
    return client.responses.create(
        model="smollm2",
        instructions=SYSTEM,
        input=QUESTION,
        max_output_tokens=24,
        temperature=0,
        **extra,
    )


def test_a_response_says_what_chat_says(client, chat_answer) -> None:
    response = ask(client)
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.status in ("completed", "incomplete")
    assert response.output_text == chat_answer
    message = response.output[0]
    assert message.type == "message" and message.id.startswith("msg_")
    assert message.content[0].type == "output_text"
    usage = response.usage
    assert usage.input_tokens > 0 and 0 < usage.output_tokens <= 24
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.input_tokens_details.cached_tokens >= 0


def test_the_token_limit_makes_a_response_incomplete(client) -> None:
    response = client.responses.create(
        model="smollm2", input="Tell me a long story.", max_output_tokens=3, temperature=0
    )
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 3


def test_a_stream_sends_responses_events_in_order(client, chat_answer) -> None:
    events = list(ask(client, stream=True))
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert kinds[-4:-1] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == chat_answer
    final = events[-1].response
    assert final.output_text == chat_answer and final.usage.output_tokens > 0
    item_ids = {e.item_id for e in events if hasattr(e, "item_id")}
    assert item_ids == {final.output[0].id}  # one item, one id throughout


def test_a_stored_response_is_retrieved_listed_continued_and_deleted(client, chat_answer) -> None:
    first = ask(client)
    assert client.responses.retrieve(first.id).output_text == first.output_text
    items = client.responses.input_items.list(first.id)
    assert [item.type for item in items.data] == ["message"]
    assert items.data[0].content[0].text == QUESTION
    follow = client.responses.create(
        model="smollm2",
        previous_response_id=first.id,
        input="And of Germany?",
        max_output_tokens=16,
        temperature=0,
    )
    # The continuation's prompt holds the whole first exchange: its prefix is served by the cache.
    assert follow.usage.input_tokens > first.usage.input_tokens + 5
    assert follow.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 16
    assert follow.previous_response_id == first.id
    deleted = client.responses.delete(first.id)
    assert deleted is None or getattr(deleted, "deleted", True)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)


def test_an_unstored_response_cannot_be_retrieved(client) -> None:
    response = ask(client, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(
            model="smollm2", previous_response_id=response.id, input="More?", max_output_tokens=4
        )


def test_structured_text_follows_its_schema(client) -> None:
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
        "required": ["city", "country"],
    }
    response = client.responses.create(
        model="smollm2",
        input="Name a European capital.",
        max_output_tokens=60,
        temperature=0,
        text={"format": {"type": "json_schema", "name": "place", "schema": schema, "strict": True}},
    )
    value = json.loads(response.output_text)
    jsonschema.validate(value, schema)
    assert set(value) == {"city", "country"}


def test_a_forced_function_call_and_its_output_round_trip(client) -> None:
    call_response = client.responses.create(
        model="smollm2",
        input="What is the weather in Paris?",
        tools=[WEATHER],
        tool_choice="required",
        max_output_tokens=60,
        temperature=0,
    )
    calls = [item for item in call_response.output if item.type == "function_call"]
    assert len(calls) >= 1
    call = calls[0]
    assert call.name == "get_weather" and call.id.startswith("fc_") and call.call_id
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    answer = client.responses.create(
        model="smollm2",
        previous_response_id=call_response.id,
        input=[
            {
                "type": "function_call_output",
                "call_id": call.call_id,
                "output": json.dumps({"temperature": "21 C"}),
            }
        ],
        tools=[WEATHER],
        max_output_tokens=24,
        temperature=0,
    )
    assert answer.status in ("completed", "incomplete") and answer.output


def test_a_streamed_function_call_sends_its_arguments_in_deltas(client) -> None:
    events = list(
        client.responses.create(
            model="smollm2",
            input="What is the weather in Oslo?",
            tools=[WEATHER],
            tool_choice={"type": "function", "name": "get_weather"},
            max_output_tokens=60,
            temperature=0,
            stream=True,
        )
    )
    added = [e for e in events if e.type == "response.output_item.added"]
    assert added and added[0].item.type == "function_call"
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done and done[0].arguments == deltas
    jsonschema.validate(json.loads(deltas), WEATHER["parameters"])
    assert events[-1].response.output[0].arguments == deltas


def test_a_background_response_is_polled_to_its_end(client) -> None:
    queued = ask(client, background=True)
    assert queued.status in ("queued", "in_progress") and queued.background
    deadline = time.monotonic() + 120
    while (current := client.responses.retrieve(queued.id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline, "the background response never finished"
        time.sleep(0.1)
    assert current.status in ("completed", "incomplete") and current.output_text


def test_cancelling_a_background_response_stops_its_generation(client, server) -> None:
    long = client.responses.create(
        model="smollm2",
        input="Write a very long story about a lighthouse keeper.",
        max_output_tokens=1500,
        temperature=0,
        extra_body={"ignore_eos": True},
        background=True,
    )
    cancelled = client.responses.cancel(long.id)
    assert cancelled.status == "cancelled"
    assert client.responses.retrieve(long.id).status == "cancelled"
    assert_idle(server[1])  # its engine request was aborted: every KV block is free again
    again = client.responses.cancel(long.id)  # cancelling a finished response changes nothing
    assert again.status == "cancelled"


def test_only_background_responses_can_be_cancelled(client) -> None:
    response = ask(client)
    with pytest.raises(openai.BadRequestError):
        client.responses.cancel(response.id)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "hi", "frequency_penalty": 1}, "frequency_penalty"),
        ({"input": [{"type": "web_search_call", "id": "x"}]}, "input.0"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input.0.content.0",
        ),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools.0"),
        ({"input": "hi", "include": ["file_search_call.results"]}, None),
        ({"input": "hi", "background": True, "store": False}, "store"),
        ({"input": "hi", "tool_choice": "required"}, "tool_choice"),
    ],
)
def test_bad_requests_are_openai_shaped_400s(server, body, param) -> None:
    url, _ = server
    response = httpx.post(url + "/v1/responses", json={"model": "smollm2", **body}, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error


def test_unknown_ids_are_404s(server) -> None:
    url, _ = server
    for method, path in (
        ("GET", "/v1/responses/resp_missing"),
        ("DELETE", "/v1/responses/resp_missing"),
        ("GET", "/v1/responses/resp_missing/input_items"),
        ("POST", "/v1/responses/resp_missing/cancel"),
    ):
        response = httpx.request(method, url + path, timeout=10)
        assert response.status_code == 404, (method, path, response.text)
        assert response.json()["error"]["code"] == "not_found"
    response = httpx.post(
        url + "/v1/responses",
        json={"model": "smollm2", "input": "hi", "previous_response_id": "resp_missing"},
        timeout=10,
    )
    assert (
        response.status_code == 404 and response.json()["error"]["param"] == "previous_response_id"
    )
