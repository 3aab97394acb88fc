"""Server-sent events as the streaming routes send them: `data:` events (named ones too), OpenAI's
`[DONE]`, and `: ping` comments as keep-alives."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from fastapi.responses import StreamingResponse

PING = ": ping\n\n"  # a comment line: clients ignore it, proxies see the connection is alive
DONE = "data: [DONE]\n\n"  # OpenAI's end of stream
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def event(data: dict, name: str | None = None) -> str:
    """One event carrying `data` as JSON; `name` sets its `event:` field."""
    head = f"event: {name}\n" if name else ""
    return f"{head}data: {json.dumps(data, ensure_ascii=False)}\n\n"


def response(events: AsyncIterator[str], headers: dict[str, str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream", headers={**HEADERS, **headers})
