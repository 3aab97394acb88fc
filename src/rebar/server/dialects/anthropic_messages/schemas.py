"""Anthropic's Messages API request bodies, and their system prompt, messages and tools read into
the pipeline's neutral conversation.

Content comes as clients send it: a string, or a list of blocks (text; `tool_use` and `thinking`
in assistant turns; `tool_result` in user turns, its content a string or text blocks). Earlier
thinking is left out of the prompt, as thinking models' own templates leave it out.
`cache_control` marks are accepted on every block: rebar's prefix cache reuses any prompt prefix
it has seen, marked or not. A block or field rebar does not take is a 400 naming where it is,
never silently dropped.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field, model_validator
from pydantic_core import PydanticCustomError

from rebar.errors import InvalidRequestError
from rebar.server.body import StrictBody, only_fields, text_field
from rebar.server.pipeline.request import FunctionTool, Message, PastToolCall, Tools

MIN_THINKING_BUDGET = 1024  # Anthropic's smallest budget_tokens
MEDIA_BLOCKS = frozenset({"image", "document", "search_result", "audio"})
ERROR_PREFIX = "Error: "  # before a tool_result's content when it says is_error


class ThinkingConfig(StrictBody):
    type: Literal["enabled", "adaptive", "disabled"]
    budget_tokens: int | None = None
    # "summarized" is accepted: rebar shows the reasoning as the model wrote it, never summarised.
    display: Literal["summarized"] | None = None

    @model_validator(mode="after")
    def _budget(self) -> ThinkingConfig:
        if self.type == "enabled" and self.budget_tokens is None:
            raise PydanticCustomError("invalid_thinking", "thinking enabled needs budget_tokens")
        budget = self.budget_tokens
        if self.type == "enabled" and budget is not None and budget < MIN_THINKING_BUDGET:
            raise PydanticCustomError(
                "invalid_thinking",
                "budget_tokens must be at least {least}",
                {"least": MIN_THINKING_BUDGET},
            )
        if self.type != "enabled" and self.budget_tokens is not None:
            raise PydanticCustomError("invalid_thinking", "budget_tokens goes with enabled")
        return self


class ToolChoice(StrictBody):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _name(self) -> ToolChoice:
        if (self.type == "tool") != (self.name is not None):
            raise PydanticCustomError("invalid_tool_choice", "a name goes with type 'tool' only")
        return self


class JsonOutputFormat(StrictBody):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(StrictBody):
    format: JsonOutputFormat | None = None
    # Accepted: rebar's models have no effort control (see docs/anthropic.md).
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None


class CacheControl(StrictBody):
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class Metadata(StrictBody):
    user_id: str | None = None  # the caller's own id for its end user; changes nothing


class _Conversation(StrictBody):
    """What both `POST /v1/messages` and `/v1/messages/count_tokens` take."""

    model: str
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    # Accepted: rebar's prefix cache reuses every prompt prefix it has seen, marked or not.
    cache_control: CacheControl | None = None


class CountTokensRequest(_Conversation):
    """`POST /v1/messages/count_tokens`."""


class MessagesRequest(_Conversation):
    """`POST /v1/messages`."""

    max_tokens: int
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    metadata: Metadata | None = None
    # Accepted and not acted on: rebar has one tier of service.
    service_tier: Literal["auto", "standard_only"] | None = None

    @model_validator(mode="after")
    def _budget_below_max_tokens(self) -> MessagesRequest:
        budget = self.thinking.budget_tokens if self.thinking else None
        if budget is not None and budget >= self.max_tokens:
            raise PydanticCustomError(
                "invalid_thinking", "thinking.budget_tokens must be less than max_tokens"
            )
        return self


# ----- into the neutral request ------------------------------------------------------------------


def conversation(body: _Conversation) -> tuple[Message, ...]:
    """The system prompt, then each message's turns; raises InvalidRequestError naming where."""
    turns: list[Message] = []
    if body.system is not None:
        system = body.system
        text = system if isinstance(system, str) else _texts(system, "system")
        turns.append(Message("system", text, "system"))
    for i, message in enumerate(body.messages):
        where = f"messages.{i}"
        if not isinstance(message, dict):
            raise InvalidRequestError(f"{where} must be an object", where)
        only_fields(message, {"role", "content"}, where)
        role, content = message.get("role"), message.get("content")
        if role not in ("user", "assistant"):
            raise InvalidRequestError(f"{where}.role must be user or assistant", f"{where}.role")
        if isinstance(content, str):
            turns.append(Message(role, content, where))
        elif not isinstance(content, list):
            raise InvalidRequestError(
                f"{where}.content must be a string or a list of blocks", f"{where}.content"
            )
        elif role == "user":
            turns += _user_turns(content, where)
        else:
            turns.append(_assistant_turn(content, where))
    return tuple(turns)


def _user_turns(blocks: list[Any], where: str) -> list[Message]:
    """A user message's blocks: each tool_result a tool turn, runs of text one user turn."""
    turns: list[Message] = []
    texts: list[str] = []
    for j, block in enumerate(blocks):
        at = f"{where}.content.{j}"
        kind = _kind(block, at)
        if kind == "text":
            texts.append(_text_block(block, at))
        elif kind == "tool_result":
            if texts:
                turns.append(Message("user", "\n".join(texts), where))
                texts = []
            turns.append(_tool_result(block, at))
        else:
            _refuse(kind, at, "text and tool_result")
    if texts or not turns:
        turns.append(Message("user", "\n".join(texts), where))
    return turns


def _assistant_turn(blocks: list[Any], where: str) -> Message:
    texts: list[str] = []
    calls: list[PastToolCall] = []
    for j, block in enumerate(blocks):
        at = f"{where}.content.{j}"
        kind = _kind(block, at)
        if kind == "text":
            texts.append(_text_block(block, at))
        elif kind == "tool_use":
            only_fields(block, {"type", "id", "name", "input", "cache_control"}, at)
            arguments = block.get("input")
            if not isinstance(arguments, dict):
                raise InvalidRequestError(f"{at}.input must be an object", f"{at}.input")
            call_id, name = (
                text_field(block.get("id"), f"{at}.id"),
                text_field(block.get("name"), f"{at}.name"),
            )
            calls.append(PastToolCall(call_id, name, json.dumps(arguments, ensure_ascii=False)))
        elif kind == "thinking":
            only_fields(block, {"type", "thinking", "signature", "cache_control"}, at)
            text_field(block.get("thinking"), f"{at}.thinking")
        elif kind == "redacted_thinking":
            only_fields(block, {"type", "data", "cache_control"}, at)
        else:
            _refuse(kind, at, "text, tool_use and thinking")
    return Message("assistant", "\n".join(texts), where, tool_calls=tuple(calls))


def _tool_result(block: dict[str, Any], at: str) -> Message:
    only_fields(block, {"type", "tool_use_id", "content", "is_error", "cache_control"}, at)
    content = block.get("content", "")
    text = content if isinstance(content, str) else _texts(content, f"{at}.content")
    is_error = block.get("is_error", False)
    if not isinstance(is_error, bool):
        raise InvalidRequestError(f"{at}.is_error must be a boolean", f"{at}.is_error")
    call_id = text_field(block.get("tool_use_id"), f"{at}.tool_use_id")
    return Message("tool", ERROR_PREFIX + text if is_error else text, at, tool_call_id=call_id)


def _texts(blocks: Any, where: str) -> str:
    """Text blocks (a system prompt, a tool result's content) joined with newlines."""
    if not isinstance(blocks, list):
        raise InvalidRequestError(f"{where} must be a string or a list of text blocks", where)
    texts = []
    for j, block in enumerate(blocks):
        at = f"{where}.{j}"
        kind = _kind(block, at)
        if kind != "text":
            _refuse(kind, at, "text")
        texts.append(_text_block(block, at))
    return "\n".join(texts)


def _text_block(block: dict[str, Any], at: str) -> str:
    only_fields(block, {"type", "text", "cache_control", "citations"}, at)
    if block.get("citations"):
        raise InvalidRequestError(f"{at}.citations are not supported", f"{at}.citations")
    return text_field(block.get("text"), f"{at}.text")


def _kind(block: Any, at: str) -> str:
    kind = block.get("type") if isinstance(block, dict) else None
    if not isinstance(kind, str):
        raise InvalidRequestError(f"{at} must be a block with a type", at)
    return kind


def _refuse(kind: str, at: str, allowed: str) -> None:
    if kind in MEDIA_BLOCKS:
        raise InvalidRequestError(f"{at} ({kind!r}): this model takes text only", at)
    raise InvalidRequestError(f"{at} has type {kind!r}; blocks here are {allowed}", at)


def tools(body: _Conversation) -> Tools | None:
    """The request's tools and tool_choice ("any" forces at least one call, "tool" that one)."""
    choice = body.tool_choice
    if not body.tools:
        if choice is not None and choice.type != "none":
            raise InvalidRequestError("tool_choice needs tools to choose from", "tool_choice")
        return None
    functions = tuple(_tool(tool, f"tools.{i}") for i, tool in enumerate(body.tools))
    parallel = not (choice and choice.disable_parallel_tool_use)
    if choice is None or choice.type == "auto":
        return Tools(functions, "auto", None, parallel)
    if choice.type == "tool":
        return Tools(functions, "auto", choice.name, parallel, choice_param="tool_choice.name")
    return Tools(functions, "required" if choice.type == "any" else "none", None, parallel)


def _tool(tool: Any, at: str) -> FunctionTool:
    if not isinstance(tool, dict):
        raise InvalidRequestError(f"{at} must be an object", at)
    kind = tool.get("type", "custom")
    if kind != "custom":
        raise InvalidRequestError(
            f"{at}: tools of type {kind!r} are not supported (client tools with an "
            "input_schema are)",
            at,
        )
    only_fields(
        tool, {"type", "name", "description", "input_schema", "cache_control", "strict"}, at
    )
    name = text_field(tool.get("name"), f"{at}.name")
    if not name:
        raise InvalidRequestError(f"{at}.name must not be empty", f"{at}.name")
    schema = tool.get("input_schema")
    if not isinstance(schema, dict) or schema.get("type") != "object":
        raise InvalidRequestError(
            f"{at}.input_schema must be a JSON schema of type object", f"{at}.input_schema"
        )
    description, strict = tool.get("description"), tool.get("strict")
    if description is not None:
        text_field(description, f"{at}.description")
    if strict is not None and not isinstance(strict, bool):
        raise InvalidRequestError(f"{at}.strict must be a boolean", f"{at}.strict")
    return FunctionTool(name, description, schema, strict)
