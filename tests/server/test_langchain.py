"""The live server driven by LangChain's `ChatOpenAI`, a second stock client: its message shapes
(system/human/AI/tool messages, content as parts) and its streaming.

Every answer LangChain hands back is checked against the chat route's own greedy answer to the very
request LangChain sent (recorded on the wire): the same text, the same tool calls with the same
arguments, the same structured object.
"""

from __future__ import annotations

import json

import httpx
import pytest

from needs import need_module

langchain_openai = need_module("langchain_openai")
messages = need_module("langchain_core.messages")

ASK = "What is the capital of France?"
SYSTEM = "You are a helpful AI assistant."


@pytest.fixture(scope="module")
def sent() -> list[dict]:
    """The JSON bodies LangChain sent, in order."""
    return []


@pytest.fixture(scope="module")
def chat(server, sent):
    url, _ = server

    def record(request: httpx.Request) -> None:
        sent.append(json.loads(request.content))

    with httpx.Client(event_hooks={"request": [record]}, timeout=120) as wire:
        yield langchain_openai.ChatOpenAI(
            base_url=url + "/v1",
            api_key="unused",
            model="smollm2",
            temperature=0,
            max_tokens=24,
            max_retries=0,
            timeout=120,
            http_client=wire,
        )


def route_answer(server, sent: list[dict]) -> dict:
    """The chat route's own (non-streamed) answer message to the last request LangChain sent."""
    url, _ = server
    body = {key: value for key, value in sent[-1].items() if key != "stream_options"}
    response = httpx.post(url + "/v1/chat/completions", json=body | {"stream": False}, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]


def route_tool_calls(message: dict) -> list[tuple[str, dict]]:
    return [
        (call["function"]["name"], json.loads(call["function"]["arguments"]))
        for call in message.get("tool_calls") or []
    ]


def langchain_tool_calls(answer) -> list[tuple[str, dict]]:
    return [(call["name"], call["args"]) for call in answer.tool_calls]


def test_invoke_answers_like_the_openai_sdk(chat, server) -> None:
    url, _ = server
    answer = chat.invoke([messages.SystemMessage(SYSTEM), messages.HumanMessage(ASK)])
    body = {
        "model": "smollm2",
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": ASK}],
        "max_tokens": 24,
        "temperature": 0,
    }
    direct = httpx.post(url + "/v1/chat/completions", json=body, timeout=120).json()
    assert (
        answer.content == direct["choices"][0]["message"]["content"] and "Paris" in answer.content
    )
    assert answer.usage_metadata["output_tokens"] == direct["usage"]["completion_tokens"]
    assert answer.response_metadata["finish_reason"] in ("stop", "length")


def test_content_as_parts_answers_as_the_same_text(chat) -> None:
    plain = chat.invoke([messages.SystemMessage(SYSTEM), messages.HumanMessage(ASK)])
    parted = chat.invoke(
        [
            messages.SystemMessage(content=[{"type": "text", "text": SYSTEM}]),
            messages.HumanMessage(content=[{"type": "text", "text": ASK}]),
        ]
    )
    assert parted.content == plain.content


def test_stream_yields_the_invoke_answer_in_pieces(chat) -> None:
    # A question not asked before: a response-cache hit would replay the answer in one piece.
    conversation = [messages.SystemMessage(SYSTEM), messages.HumanMessage("Name a red fruit.")]
    pieces = [chunk.content for chunk in chat.stream(conversation)]
    assert len([p for p in pieces if p]) > 1
    assert "".join(pieces) == chat.invoke(conversation).content


def test_a_tool_result_in_the_history_is_answered_as_the_chat_route_answers_it(
    chat, server, sent
) -> None:
    call = {"name": "weather", "args": {"city": "Paris"}, "id": "call_1", "type": "tool_call"}
    answer = chat.invoke(
        [
            messages.HumanMessage("What is the weather in Paris?"),
            messages.AIMessage(content="", tool_calls=[call]),
            messages.ToolMessage(content='{"celsius": 21}', tool_call_id="call_1"),
        ]
    )
    history = sent[-1]["messages"]
    assert [m["role"] for m in history] == ["user", "assistant", "tool"]
    assert history[1]["tool_calls"][0]["function"]["name"] == "weather"
    assert history[2] == {"role": "tool", "content": '{"celsius": 21}', "tool_call_id": "call_1"}
    route = route_answer(server, sent)
    assert answer.content == route["content"] and answer.content.strip()
    assert answer.response_metadata["finish_reason"] in ("stop", "length")


# ----- tools and structured outputs as LangChain asks for them ----------------------------------


def get_weather(city: str, unit: str) -> str:
    """The current weather in a city.

    Args:
        city: the city's name
        unit: celsius or fahrenheit
    """
    return f"21 degrees {unit} in {city}"


def test_bind_tools_with_a_forced_tool_gives_parsed_tool_calls(chat, server, sent) -> None:
    bound = chat.bind_tools([get_weather], tool_choice="get_weather").bind(max_tokens=80)
    answer = bound.invoke([messages.HumanMessage("What is the weather in Paris?")])
    assert sent[-1]["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    call = answer.tool_calls[0]
    assert call["name"] == "get_weather" and call["id"].startswith("call_")
    assert set(call["args"]) == {"city", "unit"} and isinstance(call["args"]["city"], str)
    assert langchain_tool_calls(answer) == route_tool_calls(route_answer(server, sent))
    assert answer.response_metadata["finish_reason"] == "tool_calls"


def test_bind_tools_streams_tool_call_chunks_that_add_up(chat, server, sent) -> None:
    bound = chat.bind_tools([get_weather], tool_choice="any").bind(max_tokens=80)
    chunks = list(bound.stream([messages.HumanMessage("Weather in Lisbon, please?")]))
    assert sent[-1]["stream"] is True and sent[-1]["tool_choice"] == "required"
    assert sum(len(c.tool_call_chunks) for c in chunks) > 1  # name, then fragments
    whole = chunks[0]
    for chunk in chunks[1:]:
        whole = whole + chunk
    assert whole.tool_calls and whole.tool_calls[0]["name"] == "get_weather"
    assert langchain_tool_calls(whole) == route_tool_calls(route_answer(server, sent))


def test_a_tool_answer_round_trips_through_the_history(chat, server, sent) -> None:
    bound = chat.bind_tools([get_weather], tool_choice="get_weather").bind(max_tokens=80)
    ask = messages.HumanMessage("What is the weather in Oslo?")
    call = bound.invoke([ask])
    result = messages.ToolMessage(
        get_weather(**call.tool_calls[0]["args"]), tool_call_id=call.tool_calls[0]["id"]
    )
    answer = chat.bind_tools([get_weather]).invoke([ask, call, result])
    history = sent[-1]["messages"]
    assert [m["role"] for m in history] == ["user", "assistant", "tool"]
    assert history[2]["content"] == get_weather(**call.tool_calls[0]["args"])
    route = route_answer(server, sent)
    assert answer.content == (route["content"] or "")
    assert langchain_tool_calls(answer) == route_tool_calls(route)
    assert answer.content.strip() or answer.tool_calls


@pytest.mark.parametrize("method", ["json_schema", "function_calling", "json_mode"])
def test_with_structured_output_returns_the_schema_object(chat, server, sent, method) -> None:
    import pydantic

    class City(pydantic.BaseModel):
        """A city and its country."""

        name: str = pydantic.Field(max_length=30)
        country: str = pydantic.Field(max_length=30)

    roomy = chat.model_copy(update={"max_tokens": 96})  # room for the whole object
    structured = roomy.with_structured_output(City, method=method)
    # (Worded so that this small model's greedy JSON closes within the room: "as JSON with keys
    # name and country" sits on a near-tie after `{"` that a last-bit change turns into a key
    # that never ends.)
    prompt = "Name a city in Japan. Answer with a JSON object with the keys name and country."
    result = structured.invoke([messages.HumanMessage(prompt)])
    route = route_answer(server, sent)
    if method == "function_calling":
        ((_name, expected),) = route_tool_calls(route)
    else:
        expected = json.loads(route["content"])
    # LangChain's object is the one the chat route answered, field for field.
    fields = result.model_dump() if isinstance(result, City) else result
    assert fields == expected
    if method != "json_mode":  # json_mode asks for any JSON object; the others for City
        assert isinstance(result, City) and result.name and result.country
