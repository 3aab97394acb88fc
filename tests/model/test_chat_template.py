"""Chat templates: the model's own template rendered in a sandbox, and typed errors for bad input."""

from __future__ import annotations

import pytest

from rebar.errors import InvalidRequestError, UnsupportedModelError
from rebar.model.chat_template import render_chat

CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_renders_messages_and_generation_prompt() -> None:
    text = render_chat(CHATML, [{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert not render_chat(
        CHATML, [{"role": "user", "content": "hi"}], add_generation_prompt=False
    ).endswith("assistant\n")


def test_bos_token_and_tojson_are_available() -> None:
    template = "{{ bos_token }}{{ messages[0] | tojson }}"
    assert (
        render_chat(template, [{"role": "user", "content": "é"}], bos_token="<s>")
        == '<s>{"role": "user", "content": "é"}'
    )


def test_template_raise_exception_becomes_invalid_request() -> None:
    template = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first message must be from the user') }}{% endif %}"
    with pytest.raises(InvalidRequestError, match="first message must be from the user") as info:
        render_chat(template, [{"role": "assistant", "content": "x"}])
    assert info.value.param == "messages"


def test_sandbox_blocks_attribute_escapes() -> None:
    template = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(InvalidRequestError):
        render_chat(template, [{"role": "user", "content": "x"}])


@pytest.mark.parametrize(
    "messages",
    [
        [],
        "hello",
        [{"role": "wizard", "content": "x"}],
        [{"role": "user", "content": 3}],
        ["not a dict"],
    ],
)
def test_bad_messages_are_rejected(messages) -> None:
    with pytest.raises(InvalidRequestError) as info:
        render_chat(CHATML, messages)
    assert info.value.param == "messages"


def test_no_template_is_a_clear_error() -> None:
    with pytest.raises(UnsupportedModelError, match="no chat template"):
        render_chat(None, [{"role": "user", "content": "x"}])


def test_broken_template_is_a_clear_error() -> None:
    with pytest.raises(UnsupportedModelError, match="does not compile"):
        render_chat("{% for %}", [{"role": "user", "content": "x"}])
