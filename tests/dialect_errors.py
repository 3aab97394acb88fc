"""An error body in the shape of the dialect its route belongs to: Anthropic's for /v1/messages,
OpenAI's for every other route."""

from __future__ import annotations

ANTHROPIC_PREFIX = "/v1/messages"


def assert_error_shape(path: str, body: dict) -> str:
    """The error's message, once its body has been checked for its route's shape."""
    if path.startswith(ANTHROPIC_PREFIX):
        assert set(body) == {"type", "error"} and body["type"] == "error", body
        error = body["error"]
        assert set(error) == {"type", "message"} and error["type"] and error["message"], body
        return error["message"]
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], body
    return error["message"]
