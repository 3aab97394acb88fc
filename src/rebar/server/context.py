"""What rebar's middleware and routes learn about one HTTP request, kept in its ASGI scope."""

from __future__ import annotations

import uuid
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from typing import Any

_KEY = "rebar"  # in the scope's per-request `state` dict


@dataclass
class RequestContext:
    """One request's side channel between the middleware layers and the routes.

    `internal_id` (always new) routes the work: the engine's request id and the response's `id`.
    `request_id` is the X-Request-ID label (the client's when well-formed), for logs only.
    `arrived_at` is the arrival on the metrics clock (TTFT and e2e start there); `api_key_id`
    names the matched API key when keys are on; `log` holds what the routes add to the access-log
    line (token counts, timings; texts only when `log_prompts` is on).
    """

    internal_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    request_id: str | None = None
    arrived_at: float | None = None
    api_key_id: str | None = None
    log: dict[str, Any] = field(default_factory=dict)


def request_context(scope: MutableMapping[str, Any]) -> RequestContext:
    """The request's context, made by whichever layer asks first."""
    state = scope.setdefault("state", {})
    context = state.get(_KEY)
    if context is None:
        context = state[_KEY] = RequestContext()
    return context
