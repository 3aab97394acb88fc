"""Request bodies of the OpenAI-compatible API. Unknown fields and wrong types are 400s, never
ignored."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
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


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant"]
    content: str
    name: str | None = None


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
    # Extensions beyond OpenAI's API (as vLLM names them).
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


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
