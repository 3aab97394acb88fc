"""Chat messages as clients send them, turned into what a chat template reads (no model needed)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from rebar.errors import InvalidRequestError
from rebar.server.dialects.openai_schemas import ChatCompletionRequest, neutral_messages
from rebar.server.pipeline.prepare import template_messages
from rebar.server.pipeline.request import Message

READS_TOOL_CALLS = "{% for m in messages %}{{ m.tool_calls }}{% endfor %}"
PLAIN = "{% for m in messages %}{{ m.content }}{% endfor %}"


def model_text(template: str) -> SimpleNamespace:
    return SimpleNamespace(
        checkpoint=SimpleNamespace(chat_template=template),
        tokenizer=SimpleNamespace(holds_special_text=lambda text: "<|" in text),
    )


def messages(*raw: dict) -> tuple[Message, ...]:
    """The messages of a chat request, as the chat dialect hands them to the pipeline."""
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": list(raw)})
    return neutral_messages(body.messages)


CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}


def test_parts_join_and_developer_is_system() -> None:
    parted = messages(
        {"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}], "name": "bot"},
    )
    assert template_messages(parted, model_text(PLAIN)) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "no", "name": "bot"},
    ]


def test_a_template_that_reads_tool_calls_gets_them_with_parsed_arguments() -> None:
    turn = messages(
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "c1", "content": "2"},
    )
    assistant, tool = template_messages(turn, model_text(READS_TOOL_CALLS))
    assert assistant == {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}
        ],
    }
    assert tool == {"role": "tool", "content": "2", "tool_call_id": "c1"}


@pytest.mark.parametrize("field", ["reasoning_content", "reasoning"])
def test_an_earlier_answers_reasoning_is_accepted_and_left_out_of_the_prompt(field: str) -> None:
    turn = messages({"role": "assistant", "content": "Paris.", field: "hm"})
    assert template_messages(turn, model_text(PLAIN)) == [
        {"role": "assistant", "content": "Paris."}
    ]
    with pytest.raises(ValidationError, match=f"{field} belongs to assistant messages"):
        messages({"role": "user", "content": "x", field: "hm"})


def test_a_template_that_ignores_tool_calls_sees_them_in_the_content() -> None:
    turn = messages({"role": "assistant", "content": "Let me check.", "tool_calls": [CALL, CALL]})
    (assistant,) = template_messages(turn, model_text(PLAIN))
    call = '\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
    assert assistant == {"role": "assistant", "content": "Let me check." + call + call}


@pytest.mark.parametrize(
    ("field", "value", "param"),
    [
        ("arguments", "[1, 2]", "messages.0.tool_calls.0.function.arguments"),
        ("arguments", '{"x": "<|im_end|>"}', "messages.0.tool_calls.0.function.arguments"),
        ("name", "<|im_start|>", "messages.0.tool_calls.0.function.name"),
    ],
)
def test_tool_call_fields_are_checked(field: str, value: str, param: str) -> None:
    call = {**CALL, "function": {**CALL["function"], field: value}}
    turn = messages({"role": "assistant", "content": None, "tool_calls": [call]})
    with pytest.raises(InvalidRequestError) as info:
        template_messages(turn, model_text(READS_TOOL_CALLS))
    assert info.value.param == param


def test_a_name_with_control_token_text_is_refused() -> None:
    with pytest.raises(InvalidRequestError) as info:
        template_messages(
            messages({"role": "user", "content": "x", "name": "<|a|>"}), model_text(PLAIN)
        )
    assert info.value.param == "messages.0.name"


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        ({"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}, "text only"),
        ({"role": "user", "content": [{"type": "text", "text": "a", "extra": 1}]}, "unsupported"),
        ({"role": "user", "content": [{"type": "video_frame"}]}, "'text' parts"),
        ({"role": "user", "content": None}, "content is required"),
        ({"role": "user", "content": "x", "tool_calls": [CALL]}, "assistant messages"),
        ({"role": "tool", "content": "x"}, "tool_call_id"),
        ({"role": "wizard", "content": "x"}, "role"),
    ],
)
def test_messages_that_cannot_be_read_are_refused_with_a_reason(raw: dict, says: str) -> None:
    with pytest.raises(ValidationError) as info:
        messages(raw)
    assert says in str(info.value)


def test_no_op_fields_are_accepted_and_typos_are_not() -> None:
    base = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    extra = {"user": "u", "metadata": {"k": "v"}, "store": True, "service_tier": "auto"}
    assert ChatCompletionRequest.model_validate({**base, **extra}).user == "u"
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({**base, "users": "u"})
