"""Responses API objects from the pipeline's neutral answers: the `response` object with its output
items (`reasoning`, `message`, `function_call`), and a stream's events in the order OpenAI sends
them, each with its `sequence_number`, ending in `response.completed`, `response.incomplete` or
`response.failed` with the same object a GET returns."""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from rebar.server import sse
from rebar.server.pipeline.respond import ResponseInfo
from rebar.server.pipeline.results import (
    OUT_OF_TOKENS,
    Answer,
    AnswerChoice,
    ChoiceEnd,
    Delta,
    Ping,
    StreamEnd,
    StreamItem,
    TokenLogprob,
    ToolCallDelta,
    Usage,
)

Finished = Callable[[dict[str, Any]], Awaitable[None]]  # gets the final response object


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def usage(value: Usage, reasoning_tokens: int = 0) -> dict[str, Any]:
    return {
        "input_tokens": value.prompt_tokens,
        "input_tokens_details": {"cached_tokens": value.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": value.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": value.total_tokens,
    }


def logprobs(entries: tuple[TokenLogprob, ...] | None) -> list[dict[str, Any]]:
    def item(token: str, logprob: float) -> dict[str, Any]:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    return [
        {**item(e.token, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
        for e in entries or ()
    ]


def ending(finish_reason: str | None, error: str | None) -> tuple[str, dict | None, dict | None]:
    """(status, incomplete_details, error) of a response whose answer ended so."""
    if finish_reason in ("length", OUT_OF_TOKENS):
        return "incomplete", {"reason": "max_output_tokens"}, None
    if finish_reason == "timeout":
        return "failed", None, {"code": "timeout", "message": error or "time limit exceeded"}
    if finish_reason == "error":
        return "failed", None, {"code": "server_error", "message": error or "generation failed"}
    return "completed", None, None


class ResponsesRenderer:
    """One response: `shell` holds its request-derived fields (model, instructions, tools, ...),
    `finished` receives the final object (to store it)."""

    def __init__(
        self, info: ResponseInfo, response_id: str, shell: dict[str, Any], finished: Finished
    ) -> None:
        self.info, self.id, self.shell, self.finished = info, response_id, shell, finished
        self.final: dict[str, Any] | None = None
        self._sequence = 0
        self._output: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None  # the item being streamed
        self._calls: dict[int, dict[str, Any]] = {}  # call index -> its function_call item
        self._end: ChoiceEnd | None = None

    def response(self, status: str, **fields: Any) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.info.created,
            "status": status,
            "error": None,
            "incomplete_details": None,
            "output": [],
            "usage": None,
            **self.shell,
            **fields,
        }

    # ----- whole answers -----------------------------------------------------------------
    def body(self, answer: Answer) -> dict[str, Any]:
        choice = answer.choices[0]
        status, incomplete, error = ending(choice.finish_reason, choice.error)
        self.final = self.response(
            status,
            output=output_items(choice),
            usage=usage(answer.usage),
            incomplete_details=incomplete,
            error=error,
        )
        return self.final

    async def done(self) -> None:
        if self.final is not None:
            await self.finished(self.final)

    # ----- streams -----------------------------------------------------------------------
    def _event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return sse.event(data, kind)

    def stream_start(self) -> Iterator[str]:
        created = self.response("in_progress")
        yield self._event("response.created", response=created)
        yield self._event("response.in_progress", response=created)

    def stream_item(self, item: StreamItem) -> Iterator[str]:
        if isinstance(item, Ping):
            yield sse.PING
        elif isinstance(item, StreamEnd):
            yield from self._close()
            yield from self._finish(item.usage)
        else:
            for event in item:
                if isinstance(event, Delta):
                    yield from self._delta(event)
                elif isinstance(event, ToolCallDelta):
                    yield from self._call(event)
                elif isinstance(event, ChoiceEnd):
                    self._end = event

    def stream_end(self) -> Iterator[str]:
        if self.final is None:  # the engine produced nothing: the stream failed
            yield from self._close()
            failed = {"code": "server_error", "message": "the generation produced no output"}
            self.final = self.response("failed", output=self._output, error=failed)
            yield self._event("response.failed", response=self.final)

    def _delta(self, delta: Delta) -> Iterator[str]:
        if delta.reasoning:
            yield from self._ensure("reasoning")
            assert self._open is not None
            self._open["content"][0]["text"] += delta.reasoning
            yield self._event(
                "response.reasoning_text.delta", **self._where(), delta=delta.reasoning
            )
        if delta.content:
            yield from self._ensure("message")
            assert self._open is not None
            part = self._open["content"][0]
            part["text"] += delta.content
            more = logprobs(delta.logprobs)
            if delta.logprobs is not None:
                part.setdefault("logprobs", []).extend(more)
            yield self._event(
                "response.output_text.delta", **self._where(), delta=delta.content, logprobs=more
            )

    def _call(self, delta: ToolCallDelta) -> Iterator[str]:
        if delta.id is not None:
            yield from self._close()
            item = {
                "type": "function_call",
                "id": new_id("fc"),
                "call_id": delta.id,
                "name": delta.name or "",
                "arguments": "",
                "status": "in_progress",
            }
            self._calls[delta.call_index] = self._open = item
            self._output.append(item)
            index = len(self._output) - 1
            yield self._event("response.output_item.added", output_index=index, item=dict(item))
        item = self._calls[delta.call_index]
        if delta.arguments:
            item["arguments"] += delta.arguments
            index = self._output.index(item)
            yield self._event(
                "response.function_call_arguments.delta",
                item_id=item["id"],
                output_index=index,
                delta=delta.arguments,
            )

    def _ensure(self, kind: str) -> Iterator[str]:
        """An open item of `kind` (closing the one open before it)."""
        if self._open is not None and self._open["type"] == kind:
            return
        yield from self._close()
        if kind == "reasoning":
            part: dict[str, Any] = {"type": "reasoning_text", "text": ""}
            item = {"type": "reasoning", "id": new_id("rs"), "summary": [], "content": [part]}
        else:
            part = {"type": "output_text", "text": "", "annotations": []}
            item = {"type": "message", "id": new_id("msg"), "role": "assistant", "content": [part]}
        item["status"] = "in_progress"
        self._output.append(item)
        self._open = item
        added = {**item, "content": []}
        yield self._event(
            "response.output_item.added", output_index=len(self._output) - 1, item=added
        )
        yield self._event("response.content_part.added", **self._where(), part=dict(part))

    def _where(self, item: dict[str, Any] | None = None) -> dict[str, Any]:
        """Where an item's text is (the open item's by default)."""
        item = item if item is not None else self._open
        assert item is not None
        return {"item_id": item["id"], "output_index": self._output.index(item), "content_index": 0}

    def _close(self) -> Iterator[str]:
        item, self._open = self._open, None
        if item is None:
            return
        item["status"] = "completed"
        index = self._output.index(item)
        if item["type"] == "function_call":
            yield self._event(
                "response.function_call_arguments.done",
                item_id=item["id"],
                output_index=index,
                arguments=item["arguments"],
            )
        else:
            where, part = self._where(item), item["content"][0]
            if item["type"] == "reasoning":
                yield self._event("response.reasoning_text.done", **where, text=part["text"])
            else:
                logprobs_ = part.get("logprobs", [])
                text = part["text"]
                yield self._event(
                    "response.output_text.done", **where, text=text, logprobs=logprobs_
                )
            yield self._event("response.content_part.done", **where, part=dict(part))
        yield self._event("response.output_item.done", output_index=index, item=dict(item))

    def _finish(self, value: Usage) -> Iterator[str]:
        end = self._end
        status, incomplete, error = ending(
            end.finish_reason if end else None, end.error if end else None
        )
        if status == "incomplete":
            for item in self._output:
                item["status"] = "incomplete"
        self.final = self.response(
            status,
            output=self._output,
            usage=usage(value),
            incomplete_details=incomplete,
            error=error,
        )
        kind = {"completed": "response.completed", "incomplete": "response.incomplete"}
        yield self._event(kind.get(status, "response.failed"), response=self.final)


def output_items(choice: AnswerChoice) -> list[dict[str, Any]]:
    """A whole answer's output items: its reasoning, its message, then its calls."""
    status = "incomplete" if choice.finish_reason in ("length", OUT_OF_TOKENS) else "completed"
    items: list[dict[str, Any]] = []
    if choice.reasoning:
        part = {"type": "reasoning_text", "text": choice.reasoning}
        items.append(
            {
                "type": "reasoning",
                "id": new_id("rs"),
                "summary": [],
                "content": [part],
                "status": status,
            }
        )
    if choice.content or not choice.tool_calls:
        text: dict[str, Any] = {"type": "output_text", "text": choice.content, "annotations": []}
        if choice.logprobs is not None:
            text["logprobs"] = logprobs(choice.logprobs)
        message = {"type": "message", "id": new_id("msg"), "role": "assistant", "content": [text]}
        items.append({**message, "status": status})
    for call in choice.tool_calls:
        items.append(
            {
                "type": "function_call",
                "id": new_id("fc"),
                "call_id": call.id,
                "name": call.name,
                "arguments": call.arguments,
                "status": "completed",
            }
        )
    return items
