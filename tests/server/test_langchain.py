"""The live server driven by LangChain's `ChatOpenAI`, a second stock client: its message shapes
(system/human/AI/tool messages, content as parts) and its streaming."""

from __future__ import annotations

import pytest

from needs import need_module

langchain_openai = need_module("langchain_openai")
messages = need_module("langchain_core.messages")

ASK = "What is the capital of France?"
SYSTEM = "You are a helpful AI assistant."


@pytest.fixture(scope="module")
def chat(server):
    url, _ = server
    return langchain_openai.ChatOpenAI(
        base_url=url + "/v1",
        api_key="unused",
        model="smollm2",
        temperature=0,
        max_tokens=24,
        max_retries=0,
        timeout=120,
    )


def test_invoke_answers_like_the_openai_sdk(chat, server) -> None:
    import httpx

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


def test_a_tool_result_in_the_history_is_accepted(chat) -> None:
    call = {"name": "weather", "args": {"city": "Paris"}, "id": "call_1", "type": "tool_call"}
    answer = chat.invoke(
        [
            messages.HumanMessage("What is the weather in Paris?"),
            messages.AIMessage(content="", tool_calls=[call]),
            messages.ToolMessage(content='{"celsius": 21}', tool_call_id="call_1"),
        ]
    )
    assert isinstance(answer.content, str) and answer.response_metadata["finish_reason"]
