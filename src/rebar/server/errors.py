"""Every error rebar answers with, in one place: which status code each error becomes (`STATUS`,
the one table from domain errors to HTTP), and the body shape of the dialect the request came in
(OpenAI's by default: `{"error": {"message", "type", "param", "code"}}`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from rebar.documents.errors import (
    DocumentNotAllowed,
    DocumentNotFound,
    DocumentTooLarge,
    EmptyDocument,
    EncryptedDocument,
    MalformedDocument,
    NoTextLayer,
    UnsupportedDocument,
)
from rebar.documents.generator import SummaryFailed
from rebar.documents.summarize import ContextTooSmall
from rebar.errors import InvalidRequestError, ModelNotFoundError, RebarError
from rebar.server.body import INVALID_UNICODE
from rebar.server.pipeline.errors import (
    ClientGone,
    GenerationFailed,
    GenerationTimeout,
    RateLimited,
)
from rebar.serving.errors import (
    EngineStopped,
    InsufficientMemory,
    LoadRefused,
    ModelFailed,
    ModelLoading,
    NoSuchEntry,
    NotReady,
    Overloaded,
    ReloadRefused,
    ReloadSuperseded,
    ServingError,
    ShuttingDown,
    UnknownModel,
)

# Domain error -> (status, code). Looked up along the error's class hierarchy, most specific first.
STATUS: dict[type[Exception], tuple[int, str | None]] = {
    NoSuchEntry: (404, "model_not_found"),
    UnknownModel: (400, "model_not_found"),
    ModelNotFoundError: (400, "model_not_found"),
    InvalidRequestError: (400, "invalid_value"),
    ModelLoading: (503, "model_loading"),
    ModelFailed: (503, "not_ready"),
    NotReady: (503, "not_ready"),
    EngineStopped: (503, "engine_stopped"),
    InsufficientMemory: (503, "insufficient_memory"),
    Overloaded: (503, "overloaded"),
    ShuttingDown: (503, "shutting_down"),
    LoadRefused: (409, "load_failed"),
    ReloadRefused: (409, "reload_refused"),
    ReloadSuperseded: (409, "reload_superseded"),
    RateLimited: (429, "rate_limit_exceeded"),
    ClientGone: (499, None),
    GenerationTimeout: (504, "timeout"),
    GenerationFailed: (500, "internal_error"),
    SummaryFailed: (500, "internal_error"),
    UnsupportedDocument: (415, "unsupported_document"),
    EncryptedDocument: (422, "encrypted_document"),
    NoTextLayer: (422, "no_text_layer"),
    EmptyDocument: (422, "empty_document"),
    MalformedDocument: (422, "malformed_document"),
    DocumentTooLarge: (413, "document_too_large"),
    DocumentNotAllowed: (403, "path_not_allowed"),
    DocumentNotFound: (404, "document_not_found"),
    ContextTooSmall: (400, "context_too_small"),
    RebarError: (400, "invalid_request"),  # any other error a user caused (a bad file, setting)
}
# Which request parameter an error is about, when its class says it.
_PARAM: dict[type[Exception], str] = {UnknownModel: "model", ModelNotFoundError: "model"}


class APIError(Exception):
    """An error only the HTTP layer knows (a route's own refusal): its status and code given."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}


@dataclass(frozen=True)
class Problem:
    """An error as every dialect renders it."""

    status: int
    message: str
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] | None = None


def problem_of(exc: Exception) -> Problem:
    """The status, code, parameter and headers of any error rebar raises on purpose."""
    if isinstance(exc, APIError):
        return Problem(exc.status, exc.message, exc.param, exc.code, exc.headers)
    status, code = next(
        (STATUS[cls] for cls in type(exc).__mro__ if cls in STATUS), (500, "internal_error")
    )
    param = next((_PARAM[cls] for cls in type(exc).__mro__ if cls in _PARAM), None)
    if isinstance(exc, InvalidRequestError):
        param = exc.param
    headers = None
    if isinstance(exc, ServingError) and exc.retry_after_s is not None:
        headers = {"Retry-After": str(int(exc.retry_after_s))}
    if isinstance(exc, RateLimited):
        headers = exc.headers
    return Problem(status, str(exc), param, code, headers)


_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
    504: "timeout_error",
}


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """OpenAI's error body."""
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "server_error"),
            "param": param,
            "code": code,
        }
    }


ErrorShape = Callable[[int, str, "str | None", "str | None"], dict[str, Any]]


@dataclass(frozen=True)
class ErrorStyle:
    """How a dialect answers an error: the body's shape, and the status codes it gives in place of
    rebar's own (Anthropic's clients read 529, not 503, as "overloaded, retry")."""

    shape: ErrorShape
    statuses: Mapping[int, int] = field(default_factory=dict)

    def status(self, status: int) -> int:
        return self.statuses.get(status, status)

    def body(self, status: int, message: str, param: str | None, code: str | None) -> dict:
        """The body of an error whose status is already this dialect's."""
        return self.shape(status, message, param, code)


OPENAI = ErrorStyle(error_body)


@dataclass(frozen=True)
class ErrorShapes:
    """Which error style a request gets: the dialect's whose path prefix the request's path
    starts with, else OpenAI's."""

    by_prefix: Sequence[tuple[str, ErrorStyle]] = ()

    def for_path(self, path: str) -> ErrorStyle:
        return next((style for p, style in self.by_prefix if path.startswith(p)), OPENAI)

    def response(self, path: str, problem: Problem) -> JSONResponse:
        style = self.for_path(path)
        status = style.status(problem.status)
        body = style.body(status, problem.message, problem.param, problem.code)
        return JSONResponse(body, status_code=status, headers=problem.headers)


# What pydantic puts in an error's location for the member of a union that failed: a type
# ("str", "dict[str,any]", "function-after[...]"), not a field of the request.
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "literal"})


def _is_union_tag(part: object) -> bool:
    return isinstance(part, str) and ("[" in part or part in _TYPE_TAGS)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    first = exc.errors()[0]
    location = [
        str(part) for part in first.get("loc", ()) if part != "body" and not _is_union_tag(part)
    ]
    param = ".".join(location) or None
    if first.get("type") == "json_invalid":
        return (
            "request body is not valid JSON: "
            f"{first.get('ctx', {}).get('error', first.get('msg'))}",
            None,
        )
    if first.get("type") == INVALID_UNICODE:  # the message names the field inside the body
        param = first["ctx"]["param"]
        return first["msg"], None if param == "body" else param
    if first.get("type") == "extra_forbidden":
        return f"parameter {param!r} is not supported by rebar", param
    return f"{param or 'body'}: {first.get('msg')}", param


def install_error_handlers(app: FastAPI, shapes: ErrorShapes) -> None:
    """Every error a request can raise, answered in its dialect's shape; anything unexpected is a
    500 that says to look in the log (its traceback is logged by uvicorn)."""

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        problem = Problem(400, message, param, "invalid_value")
        return shapes.response(request.url.path, problem)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        problem = Problem(exc.status_code, str(exc.detail))
        return shapes.response(request.url.path, problem)

    async def _known(request: Request, exc: Exception) -> JSONResponse:
        return shapes.response(request.url.path, problem_of(exc))

    # Handled where raised (Starlette's exception middleware); the catch-all below runs in its
    # server-error middleware, which logs the traceback.
    app.add_exception_handler(RebarError, _known)
    app.add_exception_handler(APIError, _known)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        problem = Problem(500, "internal error; see the server log", None, "internal_error")
        return shapes.response(request.url.path, problem)
