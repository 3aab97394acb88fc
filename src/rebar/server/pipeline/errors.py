"""Why the pipeline could not answer a request, in no API's terms (`rebar.server.errors` maps each
to a status code and the dialect's error shape)."""

from __future__ import annotations

from rebar.errors import RebarError


class RateLimited(RebarError):
    """A request or token limit is reached; `headers` are the limiter's x-ratelimit-* fields."""

    def __init__(self, message: str, headers: dict[str, str]) -> None:
        super().__init__(message)
        self.headers = headers


class ClientGone(RebarError):
    """The client disconnected before the answer was ready; its work was aborted."""


class GenerationTimeout(RebarError):
    """The request ran past its time limit (`limits.request_timeout_s`)."""


class GenerationFailed(RebarError):
    """The engine failed while generating; the message says how."""
