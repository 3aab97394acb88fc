"""Request bodies of the OpenAI-compatible API. Unknown fields and wrong types are 400s, never
ignored."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

INVALID_UNICODE = "invalid_unicode"


def lone_surrogate_path(
    value: Any, path: tuple[str | int, ...] = ()
) -> tuple[tuple[str | int, ...], str] | None:
    """(where, the character) of the first lone surrogate in a decoded JSON value, or None.

    JSON may spell a lone surrogate ("\\ud800"); Python decodes it to a str that no UTF-8 encoder,
    tokenizer or log line accepts, so it is refused at the edge.
    """
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            return path, value[exc.start]
        return None
    items = (
        value.items()
        if isinstance(value, dict)
        else enumerate(value)
        if isinstance(value, list)
        else ()
    )
    for key, item in items:
        if isinstance(key, str) and (found := lone_surrogate_path(key, path)) is not None:
            return found
        if (found := lone_surrogate_path(item, (*path, key))) is not None:
            return found
    return None


class _Strict(BaseModel):
    # extra="forbid": an OpenAI parameter rebar does not implement is refused, not silently dropped.
    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _proper_unicode(cls, data: Any) -> Any:
        found = lone_surrogate_path(data)
        if found is not None:
            where, char = found
            param = ".".join(str(part) for part in where) or "body"
            raise PydanticCustomError(
                INVALID_UNICODE,
                "{param}: text holds a lone surrogate (U+{code}); send valid Unicode",
                {"param": param, "code": f"{ord(char):04X}"},
            )
        return data


class StreamOptions(_Strict):
    include_usage: bool = False


class ToolCallFunction(_Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


# Content parts a text model cannot read: refused by name rather than dropped.
MEDIA_PARTS = ("image_url", "input_audio", "file", "image", "audio", "video")


class ChatMessage(_Strict):
    """A message as the OpenAI API takes it. `content` may be a list of parts: text parts are
    joined with newlines (an assistant's `refusal` parts too); a media part is refused."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # which call a tool message answers
    # An earlier answer's thinking, as clients send it back: left out of the prompt, as reasoning
    # models' own templates leave earlier thinking out.
    reasoning_content: str | None = None

    @field_validator("content", mode="after")
    @classmethod
    def _joined_parts(cls, content: str | list[dict[str, Any]] | None) -> str | None:
        if not isinstance(content, list):
            return content
        return "\n".join(_part_text(index, part) for index, part in enumerate(content))

    @model_validator(mode="after")
    def _role_fields(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise _invalid(
                "content is required (it may be null only for an assistant's tool_calls)"
            )
        if self.tool_calls is not None and self.role != "assistant":
            raise _invalid(f"tool_calls belong to assistant messages, not {self.role!r} ones")
        if self.role == "tool" and not self.tool_call_id:
            raise _invalid("a tool message needs the tool_call_id of the call it answers")
        if self.reasoning_content is not None and self.role != "assistant":
            raise _invalid(
                f"reasoning_content belongs to assistant messages, not {self.role!r} ones"
            )
        if self.tool_call_id is not None and self.role != "tool":
            raise _invalid(f"tool_call_id belongs to tool messages, not {self.role!r} ones")
        return self


def _invalid(message: str) -> PydanticCustomError:
    return PydanticCustomError("invalid_message", message)


def _part_text(index: int, part: dict[str, Any]) -> str:
    kind = part.get("type")
    field = {"text": "text", "refusal": "refusal"}.get(kind) if isinstance(kind, str) else None
    if field is None:
        if kind in MEDIA_PARTS:
            raise _invalid(f"part {index} ({kind!r}): this model takes text only")
        raise _invalid(f"part {index} has type {kind!r}; content parts are 'text' parts")
    extra = set(part) - {"type", field}
    if extra:
        raise _invalid(f"part {index} has unsupported fields {sorted(extra)}")
    text = part.get(field)
    if not isinstance(text, str):
        raise _invalid(f"part {index} needs a string {field!r}")
    return text


class JsonSchemaFormat(_Strict):
    """`response_format.json_schema`: the schema the answer must follow."""

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """`text` (the default), `json_object` (any JSON object) or `json_schema`."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise PydanticCustomError(
                "invalid_format", "type 'json_schema' needs a json_schema object"
            )
        if self.type != "json_schema" and self.json_schema is not None:
            raise PydanticCustomError(
                "invalid_format", "json_schema is given only with type 'json_schema'"
            )
        return self


class FunctionDefinition(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; none = no arguments
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: ToolChoiceFunction


class _SamplingFields(_Strict):
    """Fields shared by chat and completions, mapped onto SamplingParams."""

    model: str
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # an end-user id for the caller's own records; changes nothing
    # Extensions beyond OpenAI's API (as vLLM names them).
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    response_format: ResponseFormat | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # Accepted and not acted on: by OpenAI's definition they never change the output.
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False


class EmbeddingRequest(_Strict):
    model: str
    input: str | list[str]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]
