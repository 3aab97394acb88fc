"""Errors in Anthropic's shape, `{"type": "error", "error": {"type", "message"}}`, with its status
codes: 529 `overloaded_error` where rebar answers 503 (the waiting room is full, the model is
loading or the server is stopping), which Anthropic's clients retry."""

from __future__ import annotations

from typing import Any

from rebar.server.errors import ErrorStyle

OVERLOADED = 529
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    504: "timeout_error",
    OVERLOADED: "overloaded_error",
}


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """Anthropic's error body (it has no field for the parameter or rebar's code: the message
    names the parameter, prefixed to it when it did not)."""
    if param and param not in message:
        message = f"{param}: {message}"
    kind = _TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


ERRORS = ErrorStyle(error_body, {503: OVERLOADED})
