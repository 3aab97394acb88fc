"""Anthropic Messages objects from the pipeline's neutral answers: a `message` with its content
blocks (`thinking`, `text`, `tool_use`), and a stream's events in the order Anthropic sends them:
`message_start`, per block `content_block_start`, its deltas and `content_block_stop`, then
`message_delta` (stop reason and usage) and `message_stop`; `ping` while nothing new comes (a long
prefill), and an `error` event for a generation that failed mid-stream."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from rebar.server import sse
from rebar.server.dialects.anthropic_messages.errors import error_body
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
    ToolCallDelta,
    Usage,
)


def usage(value: Usage) -> dict[str, int]:
    """Anthropic counts the prompt tokens read from its cache apart from `input_tokens`."""
    return {
        "input_tokens": value.prompt_tokens - value.cached_tokens,
        "output_tokens": value.completion_tokens,
        "cache_read_input_tokens": value.cached_tokens,
        "cache_creation_input_tokens": 0,
    }


def stop_reason(finish_reason: str | None, has_calls: bool, stop_sequence: str | None) -> str:
    if finish_reason in ("length", OUT_OF_TOKENS):
        return "max_tokens"
    if has_calls:
        return "tool_use"
    return "stop_sequence" if stop_sequence is not None else "end_turn"


def tool_use_id(call_id: str) -> str:
    """Anthropic's `toolu_` ids for rebar's call ids."""
    return "toolu_" + call_id.removeprefix("call_")


def content_blocks(choice: AnswerChoice) -> list[dict[str, Any]]:
    """A whole answer's blocks: its thinking, its text, then its calls."""
    blocks: list[dict[str, Any]] = []
    if choice.reasoning:
        blocks.append({"type": "thinking", "thinking": choice.reasoning, "signature": ""})
    if choice.content or not (blocks or choice.tool_calls):
        blocks.append({"type": "text", "text": choice.content})
    for call in choice.tool_calls:
        blocks.append(
            {
                "type": "tool_use",
                "id": tool_use_id(call.id),
                "name": call.name,
                "input": json.loads(call.arguments),
            }
        )
    return blocks


def _event(kind: str, **fields: Any) -> str:
    return sse.event({"type": kind, **fields}, kind)


_START_BLOCKS: dict[str, dict[str, Any]] = {
    "text": {"type": "text", "text": ""},
    "thinking": {"type": "thinking", "thinking": "", "signature": ""},
}
_DELTAS = {"text": ("text_delta", "text"), "thinking": ("thinking_delta", "thinking")}


class MessagesRenderer:
    """One message, whole or streamed (Anthropic has no `n`: one choice)."""

    def __init__(self, info: ResponseInfo) -> None:
        self.info = info
        self.id = f"msg_{info.id}"
        self._num_blocks = 0
        self._open: str | None = None  # the type of the block being streamed
        self._end: ChoiceEnd | None = None
        self._over = False  # message_stop or an error event went out

    def message(self, content: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.info.model,
            "content": content,
            "stop_reason": None,
            "stop_sequence": None,
            **fields,
        }

    def body(self, answer: Answer) -> dict[str, Any]:
        choice = answer.choices[0]
        reason = stop_reason(choice.finish_reason, bool(choice.tool_calls), choice.stop_sequence)
        return self.message(
            content_blocks(choice),
            stop_reason=reason,
            stop_sequence=choice.stop_sequence if reason == "stop_sequence" else None,
            usage=usage(answer.usage),
        )

    async def done(self) -> None:
        pass  # nothing kept

    # ----- streams -----------------------------------------------------------------------
    def stream_start(self) -> Iterator[str]:
        start = {"input_tokens": self.info.num_prompt_tokens, "output_tokens": 0}
        yield _event("message_start", message=self.message([], usage=start))

    def stream_item(self, item: StreamItem) -> Iterator[str]:
        if isinstance(item, Ping):
            yield _event("ping")
        elif isinstance(item, StreamEnd):
            yield from self._finish(item.usage)
        else:
            for event in item:
                if isinstance(event, Delta):
                    yield from self._text("thinking", event.reasoning)
                    yield from self._text("text", event.content)
                elif isinstance(event, ToolCallDelta):
                    yield from self._call(event)
                elif isinstance(event, ChoiceEnd):
                    yield from self._ended(event)

    def stream_end(self) -> Iterator[str]:
        if not self._over:  # the engine produced nothing: the stream failed
            self._over = True
            yield _event("error", **error_body(500, "the generation produced no output"))

    def _text(self, kind: str, text: str) -> Iterator[str]:
        if not text or self._over:
            return
        if self._open != kind:
            yield from self._start(kind, _START_BLOCKS[kind])
        delta_type, key = _DELTAS[kind]
        yield self._delta({"type": delta_type, key: text})

    def _call(self, delta: ToolCallDelta) -> Iterator[str]:
        if self._over:
            return
        if delta.id is not None:
            block = {"type": "tool_use", "id": tool_use_id(delta.id), "name": delta.name or ""}
            yield from self._start("tool_use", {**block, "input": {}})
        if delta.arguments:
            yield self._delta({"type": "input_json_delta", "partial_json": delta.arguments})

    def _start(self, kind: str, block: dict[str, Any]) -> Iterator[str]:
        yield from self._close()
        self._open = kind
        yield _event("content_block_start", index=self._num_blocks, content_block=dict(block))

    def _delta(self, delta: dict[str, Any]) -> str:
        return _event("content_block_delta", index=self._num_blocks, delta=delta)

    def _close(self) -> Iterator[str]:
        if self._open is not None:
            yield _event("content_block_stop", index=self._num_blocks)
            self._open = None
            self._num_blocks += 1

    def _ended(self, end: ChoiceEnd) -> Iterator[str]:
        self._end = end
        if end.finish_reason in ("timeout", "error") and not self._over:
            self._over = True
            status = 504 if end.finish_reason == "timeout" else 500
            message = end.error or "generation failed"
            yield _event("error", **error_body(status, message))

    def _finish(self, value: Usage) -> Iterator[str]:
        if self._over:
            return
        if self._num_blocks == 0 and self._open is None:  # an empty answer: one empty text block
            yield from self._start("text", _START_BLOCKS["text"])
        yield from self._close()
        end = self._end
        reason = stop_reason(
            end.finish_reason if end else None,
            bool(end and end.has_tool_calls),
            end.stop_sequence if end else None,
        )
        delta = {
            "stop_reason": reason,
            "stop_sequence": end.stop_sequence if end and reason == "stop_sequence" else None,
        }
        yield _event("message_delta", delta=delta, usage=usage(value))
        yield _event("message_stop")
        self._over = True
