"""Server-sent events, as every streaming route sends them: `data:` events, `[DONE]`, error
events, and `: ping` keep-alives while nothing else is ready."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, AsyncIterator
from typing import TypeVar

from fastapi.responses import StreamingResponse

from rebar.engine.outputs import RequestOutput

PING = ": ping\n\n"  # a comment line: clients ignore it, proxies see the connection is alive
DONE = "data: [DONE]\n\n"  # OpenAI's end of stream
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
T = TypeVar("T")


def event(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def error_event(output: RequestOutput) -> str | None:
    """The error event for a choice that ended by timeout or failure; None for any other end."""
    if output.finish_reason == "timeout":
        return _error("the request exceeded its time limit", "timeout_error", "timeout")
    if output.finish_reason == "error":
        return _error(output.error or "generation failed", "server_error", "internal_error")
    return None


def _error(message: str, error_type: str, code: str) -> str:
    return event({"error": {"message": message, "type": error_type, "param": None, "code": code}})


def response(events: AsyncIterator[str], headers: dict[str, str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream", headers={**HEADERS, **headers})


async def with_pings(stream: AsyncGenerator[T, None], interval_s: float) -> AsyncIterator[T | None]:
    """Yield the stream's items, and None whenever `interval_s` passes without one (time for a
    ping).

    Closes `stream` when done or abandoned.
    """
    pending: asyncio.Future[T] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(stream.__anext__())
            done, _ = await asyncio.wait({pending}, timeout=interval_s)
            if not done:
                yield None
                continue
            task, pending = pending, None
            try:
                yield task.result()
            except StopAsyncIteration:
                return
    finally:
        if pending is not None:
            pending.cancel()
            await asyncio.gather(pending, return_exceptions=True)
        await stream.aclose()
