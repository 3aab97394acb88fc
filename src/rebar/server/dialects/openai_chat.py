"""OpenAI chat completions: `POST /v1/chat/completions`, its body read into the pipeline's neutral
request and the answer rendered back (`chat.completion`, or a stream of `chat.completion.chunk`
events ending in `[DONE]`)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from rebar.errors import InvalidRequestError
from rebar.server import sse
from rebar.server.dialects import openai_fields as fields
from rebar.server.dialects.openai_schemas import (
    ChatCompletionRequest,
    NamedToolChoice,
    neutral_messages,
    sampling_params,
)
from rebar.server.pipeline.request import FunctionTool, GenerationRequest, Tools
from rebar.server.pipeline.respond import ResponseInfo, respond
from rebar.server.pipeline.results import (
    Answer,
    AnswerChoice,
    ChoiceEnd,
    Delta,
    Event,
    Ping,
    StreamEnd,
    StreamItem,
    ToolCallDelta,
)
from rebar.server.state import server_state

router = APIRouter()


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    return await respond(server_state(request), request, neutral(body), ChatRenderer)


def neutral(body: ChatCompletionRequest) -> GenerationRequest:
    """The body as the pipeline's request; raises InvalidRequestError naming the parameter."""
    if body.max_tokens is not None and body.max_completion_tokens is not None:
        raise InvalidRequestError(
            "give max_tokens or max_completion_tokens, not both", "max_tokens"
        )
    if body.top_logprobs is not None and not body.logprobs:
        raise InvalidRequestError("top_logprobs requires logprobs=true", "top_logprobs")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    max_tokens = (
        body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    )
    return GenerationRequest(
        model=body.model,
        params=sampling_params(body, max_tokens, logprobs),
        endpoint="chat",
        messages=neutral_messages(body.messages),
        tools=_tools(body),
        stream=body.stream,
        include_usage=bool(body.stream_options and body.stream_options.include_usage),
    )


def _tools(body: ChatCompletionRequest) -> Tools | None:
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise InvalidRequestError("tool_choice needs tools to choose from", "tool_choice")
        return None
    functions = tuple(
        FunctionTool(
            t.function.name, t.function.description, t.function.parameters, t.function.strict
        )
        for t in body.tools
    )
    if isinstance(choice, NamedToolChoice):
        return Tools(functions, "auto", choice.function.name, body.parallel_tool_calls is not False)
    return Tools(functions, choice or "auto", None, body.parallel_tool_calls is not False)


class ChatRenderer:
    """Chat completion bodies and chunks; `reasoning_content` and `reasoning` only for a model that
    thinks."""

    def __init__(self, info: ResponseInfo) -> None:
        self.info = info
        self.id = f"chatcmpl-{info.id}"

    def body(self, answer: Answer) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "chat.completion",
            "created": self.info.created,
            "model": self.info.model,
            "system_fingerprint": self.info.version,
            "choices": [self._choice(c) for c in answer.choices],
            "usage": fields.usage(answer.usage),
        }

    def _choice(self, choice: AnswerChoice) -> dict[str, Any]:
        calls = [_call(c.id, c.name, c.arguments) for c in choice.tool_calls]
        message: dict[str, Any] = {
            "role": "assistant",
            "content": choice.content or (None if calls else ""),
        }
        if calls:
            message["tool_calls"] = calls
        if self.info.thinking:
            message |= _reasoning(choice.reasoning or "")
        return {
            "index": choice.index,
            "message": message,
            "logprobs": fields.chat_logprobs(choice.logprobs),
            "finish_reason": _reason(choice.finish_reason, bool(calls)),
        }

    # ----- streams -----------------------------------------------------------------------
    def stream_start(self) -> Iterator[str]:
        for index in range(self.info.n):
            delta = {"role": "assistant", "content": ""}
            yield self._chunk(
                [{"index": index, "delta": delta, "logprobs": None, "finish_reason": None}]
            )

    def stream_item(self, item: StreamItem) -> Iterator[str]:
        if isinstance(item, Ping):
            yield sse.PING
        elif isinstance(item, StreamEnd):
            if self.info.include_usage:
                extra = {} if item.timing is None else {"timing": item.timing}
                yield self._chunk([], usage=fields.usage(item.usage), **extra)
        else:
            for event in item:
                yield from self._event(event)

    def stream_end(self) -> Iterator[str]:
        yield sse.DONE

    async def done(self) -> None:
        pass  # nothing kept

    def _event(self, event: Event) -> Iterator[str]:
        if isinstance(event, Delta):
            delta = _reasoning(event.reasoning) if event.reasoning else {}
            if event.content or not event.reasoning:
                delta["content"] = event.content
            yield self._piece(event.index, delta, fields.chat_logprobs(event.logprobs))
        elif isinstance(event, ToolCallDelta):
            call: dict[str, Any] = {"index": event.call_index}
            if event.id is not None:
                call |= _call(event.id, event.name or "", event.arguments)
            else:
                call["function"] = {"arguments": event.arguments}
            yield self._piece(event.index, {"tool_calls": [call]})
        elif isinstance(event, ChoiceEnd):
            yield from fields.error_event(event)
            reason = _reason(event.finish_reason, event.has_tool_calls)
            yield self._chunk(
                [{"index": event.index, "delta": {}, "logprobs": None, "finish_reason": reason}]
            )

    def _piece(self, index: int, delta: dict[str, Any], logprobs: dict | None = None) -> str:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": None}
        return self._chunk([choice])

    def _chunk(self, choices: list[dict[str, Any]], **extra: Any) -> str:
        return sse.event(
            {
                "id": self.id,
                "object": "chat.completion.chunk",
                "created": self.info.created,
                "model": self.info.model,
                "system_fingerprint": self.info.version,
                "choices": choices,
                **extra,
            }
        )


def _call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _reasoning(text: str) -> dict[str, str]:
    """Reasoning under both names clients read: `reasoning_content` (DeepSeek's) and `reasoning`
    (vLLM's and Ollama's newer one)."""
    return {"reasoning_content": text, "reasoning": text}


def _reason(reason: str | None, has_calls: bool) -> str | None:
    """OpenAI's finish_reason: "tool_calls" for an answer that ended by calling tools."""
    reason = fields.finish_reason(reason)
    return "tool_calls" if has_calls and reason == "stop" else reason
