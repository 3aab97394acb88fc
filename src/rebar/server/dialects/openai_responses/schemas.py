"""The Responses API's request body, and its input items read into the pipeline's neutral
conversation.

Input items come as clients send them: a string, or a list of messages (text parts only),
`function_call` and `function_call_output` items, and `reasoning` items sent back (left out of the
prompt, as reasoning models' own templates leave earlier thinking out). A field or item rebar does
not take is a 400 naming where it is, never silently dropped.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator
from pydantic_core import PydanticCustomError

from rebar.errors import InvalidRequestError
from rebar.server.body import StrictBody, only_fields, text_field
from rebar.server.pipeline.request import FunctionTool, Message, PastToolCall, Role

TOOL_NAME = r"^[A-Za-z0-9_-]{1,64}$"
# `include` values: the output text's logprobs; encrypted reasoning is accepted (rebar keeps
# reasoning in plain text in its items, so there is nothing to encrypt).
LOGPROBS = "message.output_text.logprobs"
INCLUDABLE = frozenset({LOGPROBS, "reasoning.encrypted_content"})


class TextFormat(StrictBody):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, pattern=TOOL_NAME)
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_fields(self) -> TextFormat:
        if self.type == "json_schema" and (self.name is None or self.schema_ is None):
            raise PydanticCustomError(
                "invalid_format", "type 'json_schema' needs a name and a schema"
            )
        if self.type != "json_schema" and (self.schema_ is not None or self.strict is not None):
            raise PydanticCustomError("invalid_format", "schema and strict go with 'json_schema'")
        return self


class TextConfig(StrictBody):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # accepted: no effect


class ReasoningConfig(StrictBody):
    # Accepted and stated in docs/responses.md: rebar's models think as their template says.
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class FunctionChoice(StrictBody):
    type: Literal["function"]
    name: str


class McpChoice(StrictBody):
    """A call of one MCP server's tool (`name`)."""

    type: Literal["mcp"]
    server_label: str
    name: str


class StreamOptions(StrictBody):
    include_obfuscation: bool | None = None  # accepted: rebar pads nothing


class ResponsesRequest(StrictBody):
    """`POST /v1/responses`."""

    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | McpChoice | None = None
    parallel_tool_calls: bool | None = None
    max_tool_calls: int | None = Field(None, ge=1)  # MCP calls rebar runs for this response
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    include: list[str] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    stream: bool = False
    stream_options: StreamOptions | None = None
    store: bool = True
    background: bool = False
    previous_response_id: str | None = None
    truncation: Literal["disabled"] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    # Accepted and not acted on: they name the caller or a cache for OpenAI's own bookkeeping.
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None
    # Extensions beyond OpenAI's API (as rebar's chat takes them).
    seed: int | None = None
    top_k: int = 0
    min_p: float = 0.0
    ignore_eos: bool = False

    @model_validator(mode="after")
    def _known_includes(self) -> ResponsesRequest:
        for value in self.include or ():
            if value not in INCLUDABLE:
                raise PydanticCustomError(
                    "invalid_include",
                    "include {value!r} is not supported (rebar supports {known})",
                    {"value": value, "known": ", ".join(sorted(INCLUDABLE))},
                )
        return self


def function_tools(tools: list[dict[str, Any]]) -> tuple[FunctionTool, ...]:
    """The request's function tools, in the Responses API's flat shape (its `mcp` tools are read
    by `mcp_tools`)."""
    found = []
    for i, tool in enumerate(tools):
        where = f"tools.{i}"
        kind = tool.get("type")
        if kind == "mcp":
            continue
        if kind != "function":
            raise InvalidRequestError(
                f"{where}: tools of type {kind!r} are not supported (function and mcp tools are)",
                where,
            )
        only_fields(tool, {"type", "name", "description", "parameters", "strict"}, where)
        name, parameters = tool.get("name"), tool.get("parameters")
        if not isinstance(name, str) or not name:
            raise InvalidRequestError(f"{where}.name must be a non-empty string", f"{where}.name")
        if parameters is not None and not isinstance(parameters, dict):
            raise InvalidRequestError(
                f"{where}.parameters must be an object", f"{where}.parameters"
            )
        description, strict = tool.get("description"), tool.get("strict")
        found.append(FunctionTool(name, _text_or_none(description, where), parameters, strict))
    return tuple(found)


def conversation(items: str | list[dict[str, Any]], param: str = "input") -> list[Message]:
    """Input items as the neutral conversation; raises InvalidRequestError naming the item."""
    if isinstance(items, str):
        return [Message("user", items, param)]
    messages: list[Message] = []
    for i, item in enumerate(items):
        where = f"{param}.{i}"
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            messages.append(_message(item, where))
        elif kind == "function_call":
            _add_call(messages, item, where)
        elif kind == "function_call_output":
            messages.append(_call_output(item, where))
        elif kind == "reasoning":
            only_fields(
                item, {"type", "id", "summary", "content", "encrypted_content", "status"}, where
            )
        elif kind == "mcp_call":
            _add_mcp_call(messages, item, where)
        elif kind == "mcp_list_tools":  # what a server offered then: not part of the prompt
            only_fields(item, {"type", "id", "server_label", "tools", "error"}, where)
        else:
            raise InvalidRequestError(
                f"{where}: input items of type {kind!r} are not supported (messages, "
                "function_call, function_call_output, mcp_call, mcp_list_tools and reasoning "
                "items are)",
                where,
            )
    return messages


_ROLES: dict[str, Role] = {
    "user": "user",
    "system": "system",
    "developer": "system",
    "assistant": "assistant",
}


def _message(item: dict[str, Any], where: str) -> Message:
    only_fields(item, {"type", "role", "content", "id", "status", "phase"}, where)
    role = _ROLES.get(str(item.get("role")))
    if role is None:
        raise InvalidRequestError(
            f"{where}.role must be one of user, system, developer, assistant", f"{where}.role"
        )
    content = item.get("content")
    if isinstance(content, str):
        return Message(role, content, where)
    if not isinstance(content, list):
        raise InvalidRequestError(
            f"{where}.content must be a string or a list of parts", f"{where}.content"
        )
    parts = [_part(part, f"{where}.content.{j}") for j, part in enumerate(content)]
    return Message(role, "\n".join(parts), where)


def _part(part: Any, where: str) -> str:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in ("input_text", "output_text"):
        only_fields(part, {"type", "text", "annotations", "logprobs"}, where)
        return text_field(part.get("text"), f"{where}.text")
    if kind == "refusal":
        only_fields(part, {"type", "refusal"}, where)
        return text_field(part.get("refusal"), f"{where}.refusal")
    if kind in ("input_image", "input_file", "input_audio"):
        raise InvalidRequestError(f"{where} ({kind!r}): this model takes text only", where)
    raise InvalidRequestError(
        f"{where} has type {kind!r}; content parts are input_text or output_text", where
    )


def _add_call(messages: list[Message], item: dict[str, Any], where: str) -> None:
    """An earlier call: joined to the assistant turn it follows, else a turn of its own."""
    only_fields(item, {"type", "id", "call_id", "name", "arguments", "status", "namespace"}, where)
    call = PastToolCall(
        text_field(item.get("call_id"), f"{where}.call_id"),
        text_field(item.get("name"), f"{where}.name"),
        text_field(item.get("arguments"), f"{where}.arguments"),
    )
    last = messages[-1] if messages else None
    if last is not None and last.role == "assistant":
        calls = (*last.tool_calls, call)
        messages[-1] = Message("assistant", last.content, last.param, tool_calls=calls)
    else:
        messages.append(Message("assistant", "", where, tool_calls=(call,)))


def _add_mcp_call(messages: list[Message], item: dict[str, Any], where: str) -> None:
    """An earlier MCP call rebar ran: the call, then its output (or error) as the tool's turn."""
    fields = {"type", "id", "server_label", "name", "arguments", "output", "error", "status"}
    only_fields(item, fields | {"approval_request_id"}, where)
    call_id = text_field(item.get("id"), f"{where}.id")
    _add_call(
        messages,
        {
            "type": "function_call",
            "call_id": call_id,
            "name": item.get("name"),
            "arguments": item.get("arguments"),
        },
        where,
    )
    error = item.get("error")
    text = f"error: {error}" if error else (item.get("output") or "")
    messages.append(
        Message("tool", text_field(text, f"{where}.output"), where, tool_call_id=call_id)
    )


def _call_output(item: dict[str, Any], where: str) -> Message:
    only_fields(item, {"type", "id", "call_id", "output", "status"}, where)
    output = item.get("output")
    if isinstance(output, list):
        text = "\n".join(_part(p, f"{where}.output.{j}") for j, p in enumerate(output))
    else:
        text = text_field(output, f"{where}.output")
    call_id = text_field(item.get("call_id"), f"{where}.call_id")
    return Message("tool", text, where, tool_call_id=call_id)


def _text_or_none(value: Any, where: str) -> str | None:
    return None if value is None else text_field(value, f"{where}.description")
