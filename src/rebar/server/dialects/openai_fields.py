"""Response fields the OpenAI dialects share: finish reasons, usage, logprobs, stream error events
and the stream's framing."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from rebar.server import sse
from rebar.server.pipeline.results import (
    OUT_OF_TOKENS,
    ChoiceEnd,
    TokenLogprob,
    Usage,
)


def finish_reason(reason: str | None) -> str | None:
    # OpenAI knows "stop" and "length": a choice cut by the tokens-per-minute limit ran out of
    # length; an aborted or failed one is reported as stopped.
    if reason == OUT_OF_TOKENS:
        return "length"
    return reason if reason in (None, "stop", "length") else "stop"


def usage(value: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": value.prompt_tokens,
        "completion_tokens": value.completion_tokens,
        "total_tokens": value.total_tokens,
        "prompt_tokens_details": {"cached_tokens": value.cached_tokens},
    }


def chat_logprobs(entries: tuple[TokenLogprob, ...] | None) -> dict | None:
    if not entries:
        return None

    def item(token: str, logprob: float) -> dict:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    return {
        "content": [
            {**item(e.token, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
            for e in entries
        ]
    }


def completion_logprobs(
    entries: tuple[TokenLogprob, ...] | None, text_offset: int = 0
) -> dict | None:
    if not entries:
        return None
    offsets = []
    for entry in entries:
        offsets.append(text_offset)
        text_offset += len(entry.token)
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [dict(e.top) for e in entries],
        "text_offset": offsets,
    }


def error_event(end: ChoiceEnd) -> Iterator[str]:
    """The error event for a choice that ended by timeout or failure; none for any other end."""
    if end.finish_reason == "timeout":
        yield _error("the request exceeded its time limit", "timeout_error", "timeout")
    elif end.finish_reason == "error":
        yield _error(end.error or "generation failed", "server_error", "internal_error")


def _error(message: str, error_type: str, code: str) -> str:
    return sse.event(
        {"error": {"message": message, "type": error_type, "param": None, "code": code}}
    )
