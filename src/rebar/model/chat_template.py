"""Render a model's own chat template (Jinja2) in a sandbox, as Hugging Face does."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from rebar.errors import InvalidRequestError, UnsupportedModelError

ROLES = ("system", "user", "assistant", "tool")


class TemplateError(InvalidRequestError):
    """The template refused the conversation (e.g. roles that do not alternate)."""


def _raise_exception(message: str) -> None:
    raise TemplateError(message, "messages")


def _tojson(
    value: Any, indent: int | None = None, ensure_ascii: bool = False, sort_keys: bool = False
) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


@lru_cache(maxsize=8)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise UnsupportedModelError(f"the model's chat template does not compile: {exc}") from exc


def validate_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Check the OpenAI-style message list and return plain dicts."""
    if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
        raise InvalidRequestError("messages must be a non-empty list", "messages")
    clean = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise InvalidRequestError(f"messages[{index}] must be an object", "messages")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise InvalidRequestError(
                f"messages[{index}].role must be one of {ROLES}, got {role!r}", "messages"
            )
        if not isinstance(content, str):
            raise InvalidRequestError(f"messages[{index}].content must be a string", "messages")
        clean.append(dict(message))
    return clean


def render_chat(
    template: str | None,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> str:
    """The prompt text for `messages` (and `tools`, for templates that read them); errors are
    typed (no template, bad messages, template refusal)."""
    if template is None:
        raise UnsupportedModelError(
            "this model has no chat template; use a plain completion instead"
        )
    clean = validate_messages(messages)
    try:
        return _compile(template).render(
            messages=clean,
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
            **({} if tools is None else {"tools": list(tools)}),
        )
    except TemplateError:
        raise
    except jinja2.TemplateError as exc:
        raise InvalidRequestError(
            f"the chat template failed on these messages: {exc}", "messages"
        ) from exc
