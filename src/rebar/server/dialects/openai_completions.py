"""OpenAI (legacy) completions: `POST /v1/completions`, a bare prompt (text or token ids) completed
`n` times, optionally echoed, rendered as `text_completion` bodies and chunks."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from rebar.errors import InvalidRequestError
from rebar.server import sse
from rebar.server.dialects import openai_fields as fields
from rebar.server.dialects.openai_schemas import CompletionRequest, sampling_params
from rebar.server.pipeline.request import GenerationRequest
from rebar.server.pipeline.respond import ResponseInfo, respond
from rebar.server.pipeline.results import (
    Answer,
    ChoiceEnd,
    Delta,
    Ping,
    StreamEnd,
    StreamItem,
    TokenLogprob,
)
from rebar.server.state import server_state

router = APIRouter()


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    return await respond(server_state(request), request, neutral(body), CompletionRenderer)


def neutral(body: CompletionRequest) -> GenerationRequest:
    """The body as the pipeline's request; raises InvalidRequestError naming the parameter."""
    if body.echo and body.logprobs is not None:
        raise InvalidRequestError(
            "echo together with logprobs (prompt logprobs) is not supported", "echo"
        )
    return GenerationRequest(
        model=body.model,
        params=sampling_params(body, body.max_tokens, body.logprobs),
        endpoint="completions",
        prompt=single_prompt(body.prompt),
        stream=body.stream,
        include_usage=bool(body.stream_options and body.stream_options.include_usage),
        echo=body.echo,
    )


def single_prompt(prompt: str | list) -> str | list[int]:
    """rebar serves one prompt per request (use `n` for several completions of it)."""
    if isinstance(prompt, str):
        return prompt
    if prompt and all(isinstance(t, int) for t in prompt):
        return prompt
    if len(prompt) == 1:
        return prompt[0]
    raise InvalidRequestError(
        "send one prompt per request (a string or a list of token ids); batches are not supported",
        "prompt",
    )


class CompletionRenderer:
    def __init__(self, info: ResponseInfo) -> None:
        self.info = info
        self.id = f"cmpl-{info.id}"
        # characters streamed so far per choice, for logprobs' text_offset
        self.offsets = dict.fromkeys(range(info.n), 0)

    def body(self, answer: Answer) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.info.created,
            "model": self.info.model,
            "system_fingerprint": self.info.version,
            "choices": [
                {
                    "index": c.index,
                    "text": self.info.echo_text + c.content,
                    "logprobs": fields.completion_logprobs(c.logprobs),
                    "finish_reason": fields.finish_reason(c.finish_reason),
                }
                for c in answer.choices
            ],
            "usage": fields.usage(answer.usage),
        }

    def stream_start(self) -> Iterator[str]:
        if self.info.echo_text:
            for index in range(self.info.n):
                yield self._piece(index, self.info.echo_text, None, 0, None)

    def stream_item(self, item: StreamItem) -> Iterator[str]:
        if isinstance(item, Ping):
            yield sse.PING
        elif isinstance(item, StreamEnd):
            if self.info.include_usage:
                extra = {} if item.timing is None else {"timing": item.timing}
                yield self._chunk([], usage=fields.usage(item.usage), **extra)
        else:
            # One engine output is one chunk: its text, and how the choice ended if it did.
            deltas = {e.index: e for e in item if isinstance(e, Delta)}
            ends = {e.index: e for e in item if isinstance(e, ChoiceEnd)}
            for index in sorted(deltas.keys() | ends.keys()):
                yield from self._output(deltas.get(index), ends.get(index), index)

    def stream_end(self) -> Iterator[str]:
        yield sse.DONE

    async def done(self) -> None:
        pass  # nothing kept

    def _output(self, delta: Delta | None, end: ChoiceEnd | None, index: int) -> Iterator[str]:
        text = delta.content if delta else ""
        offset = self.offsets[index]
        self.offsets[index] += len(text)
        if end is not None:
            yield from fields.error_event(end)
        reason = end.finish_reason if end else None
        yield self._piece(index, text, delta.logprobs if delta else None, offset, reason)

    def _piece(
        self,
        index: int,
        text: str,
        logprobs: tuple[TokenLogprob, ...] | None,
        offset: int,
        reason: str | None,
    ) -> str:
        choice = {
            "index": index,
            "text": text,
            "logprobs": fields.completion_logprobs(logprobs, offset),
            "finish_reason": fields.finish_reason(reason),
        }
        return self._chunk([choice])

    def _chunk(self, choices: list[dict[str, Any]], **extra: Any) -> str:
        return sse.event(
            {
                "id": self.id,
                "object": "text_completion",
                "created": self.info.created,
                "model": self.info.model,
                "system_fingerprint": self.info.version,
                "choices": choices,
                **extra,
            }
        )
