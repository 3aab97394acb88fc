"""OpenAI-style error bodies: `{"error": {"message", "type", "param", "code"}}`, for every 4xx/5xx
we send."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from rebar.errors import InvalidRequestError, ModelNotFoundError, RebarError
from rebar.server.schemas import INVALID_UNICODE

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
    504: "timeout_error",
}


class APIError(Exception):
    """Raise from a route to answer with an OpenAI error body."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = (
            status,
            message,
            param,
            code,
            headers or {},
        )


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "server_error"),
            "param": param,
            "code": code,
        }
    }


def error_response(
    status: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    return JSONResponse(
        error_body(status, message, param, code), status_code=status, headers=headers
    )


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


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, exc.code, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(400, message, param, "invalid_value")

    @app.exception_handler(InvalidRequestError)
    async def _invalid_value(_: Request, exc: InvalidRequestError) -> JSONResponse:
        return error_response(400, str(exc), exc.param, "invalid_value")

    @app.exception_handler(ModelNotFoundError)
    async def _no_model(_: Request, exc: ModelNotFoundError) -> JSONResponse:
        return error_response(400, str(exc), "model", "model_not_found")

    @app.exception_handler(RebarError)
    async def _rebar(_: Request, exc: RebarError) -> JSONResponse:
        return error_response(400, str(exc), None, "invalid_request")

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail), None, None)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        return error_response(500, "internal error; see the server log", None, "internal_error")
