"""Request bodies of the OpenAI API (chat, completions, embeddings, tokenize) and what their
dialects share in reading them into the pipeline's neutral request. Unknown fields and wrong types
are 400s, never ignored."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal, cast

from pydantic import Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from rebar.server.body import StrictBody
from rebar.server.pipeline.request import (
    Message,
    PastToolCall,
    SamplingParams,
    StructuredOutput,
)


class StreamOptions(StrictBody):
    include_usage: bool = False


class ToolCallFunction(StrictBody):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(StrictBody):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


# Content parts a text model cannot read: refused by name rather than dropped.
MEDIA_PARTS = ("image_url", "input_audio", "file", "image", "audio", "video")


class ChatMessage(StrictBody):
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
    reasoning: str | None = None  # the same, as vLLM and Ollama name it

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
        for name in ("reasoning_content", "reasoning"):
            if getattr(self, name) is not None and self.role != "assistant":
                raise _invalid(f"{name} belongs to assistant messages, not {self.role!r} ones")
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


class JsonSchemaFormat(StrictBody):
    """`response_format.json_schema`: the schema the answer must follow."""

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(StrictBody):
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


class FunctionDefinition(StrictBody):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; none = no arguments
    strict: bool | None = None


class Tool(StrictBody):
    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(StrictBody):
    name: str


class NamedToolChoice(StrictBody):
    type: Literal["function"]
    function: ToolChoiceFunction


class _SamplingFields(StrictBody):
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
    speculative: bool = True  # false: no speculative decoding for this request (same output)


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


class EmbeddingRequest(StrictBody):
    model: str
    # A text, texts, token ids or lists of token ids (as OpenAI's spec takes them).
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None  # an end-user id for the caller's own records; changes nothing
    # vLLM's extension: cut inputs longer than this many tokens (-1: the model's window) instead
    # of refusing them; rebar keeps each input's head (and a closing special token).
    truncate_prompt_tokens: int | None = None


class TokenizeRequest(StrictBody):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True


class DetokenizeRequest(StrictBody):
    model: str | None = None
    tokens: list[int]


# ----- into the neutral request ------------------------------------------------------------------


def neutral_messages(messages: Sequence[ChatMessage]) -> tuple[Message, ...]:
    """`developer` as `system` (the templates know no developer role), a null content as "";
    an earlier answer's `reasoning_content` (or `reasoning`) is left out, as reasoning models' own
    templates leave earlier thinking out."""
    return tuple(
        Message(
            "system" if m.role == "developer" else m.role,
            m.content if isinstance(m.content, str) else "",  # parts were joined into text
            f"messages.{i}",
            name=m.name,
            tool_calls=tuple(
                PastToolCall(c.id, c.function.name, c.function.arguments)
                for c in m.tool_calls or ()
            ),
            tool_call_id=m.tool_call_id,
        )
        for i, m in enumerate(messages)
    )


def sampling_params(
    body: _SamplingFields, max_tokens: int | None, logprobs: int | None
) -> SamplingParams:
    """Raises InvalidRequestError naming the parameter for any out-of-range value."""
    return SamplingParams(
        n=body.n,
        max_tokens=max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        min_p=body.min_p,
        seed=body.seed,
        stop=(body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ()),
        stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=body.ignore_eos,
        skip_special_tokens=body.skip_special_tokens,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty,
        # JSON keys are strings; SamplingParams reads decimal ones as token ids and refuses others.
        logit_bias=cast(Mapping[int, float] | None, body.logit_bias),
        logprobs=logprobs,
        structured=structured_output(body.response_format, "response_format"),
        speculative=body.speculative,
    )


def structured_output(fmt: ResponseFormat | None, param: str) -> StructuredOutput | None:
    """What a `response_format` asks the output to be (None: free text)."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutput.json_object()
    assert fmt.json_schema is not None  # the schema's validator requires it
    schema = fmt.json_schema.schema_
    return StructuredOutput.json_schema(
        {"type": "object"} if schema is None else schema,
        # Objects are closed unless the client says strict: false (as vLLM and llama.cpp close
        # them): a small model given room for more keys keeps adding them.
        strict=fmt.json_schema.strict is not False,
        param=f"{param}.json_schema.schema",
    )
