"""Reading one streamed OpenAI-style response into its measurements: the SSE framing, each chunk's
content, finish reason, usage and error, and the failure causes `rebar bench serve` counts."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


@dataclass
class RequestResult:
    """One request's measurements; times are seconds from `time.perf_counter()`."""

    ok: bool = False
    error: str | None = None  # the failure cause, see rebar_bench.serve's docstring
    error_message: str = ""
    ttft_s: float | None = None  # None when no content chunk arrived
    itl_s: list[float] = field(default_factory=list)  # one gap per content chunk after the first
    e2e_s: float = 0.0
    output_tokens: int = 0
    num_content_chunks: int = 0
    usage_output_tokens: int | None = None  # `usage.completion_tokens` when the server reported it


class SseDecoder:
    """Turns the lines of a `text/event-stream` body into `data` payloads.

    Comment lines (`: ping`) and fields other than `data` are ignored; the data lines of one event
    are joined at the blank line that ends it. A server that leaves out the blank lines still works:
    a joined payload that is not JSON is handed back line by line."""

    def __init__(self) -> None:
        self._data: list[str] = []

    def feed(self, line: str) -> list[str]:
        if not line:
            return self.flush()
        if line.startswith(":"):
            return []
        name, _, value = line.partition(":")
        if name == "data":
            self._data.append(value[1:] if value.startswith(" ") else value)
        return []

    def flush(self) -> list[str]:
        data, self._data = self._data, []
        if len(data) <= 1:
            return data
        joined = "\n".join(data)
        try:
            json.loads(joined)
        except ValueError:
            return data
        return [joined]


class StreamReader:
    """Applies one request's SSE payloads to its RequestResult as they arrive."""

    def __init__(self, result: RequestResult, endpoint: str, start: float) -> None:
        self.result = result
        self.endpoint = endpoint
        self.start = start
        self.last_content: float | None = None
        self.finished = False  # `[DONE]` or a finish reason was seen

    def handle(self, payload: str, now: float) -> bool:
        """Returns False once the stream has failed and reading should stop."""
        if payload.strip() == "[DONE]":
            self.finished = True
            return True
        try:
            chunk = json.loads(payload)
        except ValueError:
            return self._fail("bad_chunk", f"data line is not JSON: {payload[:200]!r}")
        if not isinstance(chunk, dict):
            return self._fail("bad_chunk", f"data line is not a JSON object: {payload[:200]!r}")
        if chunk.get("error"):
            return self._fail("stream_error", error_message(chunk))
        choices = chunk.get("choices") or []
        choice = (
            choices[0]
            if isinstance(choices, list) and choices and isinstance(choices[0], dict)
            else {}
        )
        if self._content(choice):
            self._content_arrived(now)
        if choice.get("finish_reason"):
            self.finished = True
        usage = chunk.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            self.result.usage_output_tokens = usage["completion_tokens"]
        return True

    def handle_all(self, payloads: list[str], now: float) -> bool:
        return all(self.handle(payload, now) for payload in payloads)

    def _content(self, choice: dict[str, Any]) -> str:
        if self.endpoint == "completions":
            return choice.get("text") or ""
        delta = choice.get("delta") or {}
        # Reasoning models stream their thinking in `reasoning_content`; those are output tokens
        # too.
        return delta.get("content") or delta.get("reasoning_content") or ""

    def _content_arrived(self, now: float) -> None:
        if self.last_content is None:
            self.result.ttft_s = now - self.start
        else:
            self.result.itl_s.append(now - self.last_content)
        self.last_content = now
        self.result.num_content_chunks += 1

    def _fail(self, cause: str, message: str) -> bool:
        self.result.error, self.result.error_message = cause, message
        return False


def error_message(body: Any) -> str:
    """The human-readable part of an OpenAI-style error body (or the body itself, shortened)."""
    if isinstance(body, (bytes, str)):
        text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
        try:
            body = json.loads(text)
        except ValueError:
            return text.strip()[:200]
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict) and error.get("message"):
        return str(error["message"])[:200]
    return json.dumps(body)[:200]
