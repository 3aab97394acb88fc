"""ASGI middleware: request ids, body-size limit, API-key auth. Pure ASGI so streaming responses pass through."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Awaitable, Callable

from rebar.server.errors import error_body

Scope = dict
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

_VALID_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")


async def send_error(send: Send, status: int, message: str, headers: list[tuple[bytes, bytes]] | None = None, code: str | None = None) -> None:
    body = json.dumps(error_body(status, message, None, code)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key == name:
            return value.decode("latin-1")
    return None


class RequestIdMiddleware:
    """Every response carries X-Request-ID: the client's (when well-formed) or a new one."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = _header(scope, b"x-request-id")
        request_id = given if given and _VALID_REQUEST_ID.fullmatch(given) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id

        async def send_with_id(message: dict) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id.encode())]
            await send(message)

        await self.app(scope, receive, send_with_id)


class BodySizeLimitMiddleware:
    """413 for bodies over `max_bytes`, whether announced by Content-Length or streamed chunked."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = _header(scope, b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await send_error(send, 413, f"request body exceeds {self.max_bytes} bytes", code="body_too_large")
        received = 0
        too_large = False

        async def counting_receive() -> dict:
            nonlocal received, too_large
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    too_large = True
                    raise _BodyTooLarge
            return message

        started = False

        async def tracking_send(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except _BodyTooLarge:
            if not started:
                await send_error(send, 413, f"request body exceeds {self.max_bytes} bytes", code="body_too_large")


class _BodyTooLarge(Exception):
    pass


OPEN_PATHS = ("/health", "/ready", "/docs", "/openapi.json", "/docs/oauth2-redirect", "/redoc")


class ApiKeyMiddleware:
    """401 with an OpenAI error body unless `Authorization: Bearer <key>` matches; open paths stay open."""

    def __init__(self, app: ASGIApp, check: Callable[[str | None], bool], open_paths: tuple[str, ...] = OPEN_PATHS) -> None:
        self.app, self.check, self.open_paths = app, check, open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths or scope["path"] == "/" or scope["path"].startswith("/static"):
            return await self.app(scope, receive, send)
        if not self.check(_header(scope, b"authorization")):
            return await send_error(send, 401, "invalid or missing API key (Authorization: Bearer <key>)",
                                    [(b"www-authenticate", b"Bearer")], code="invalid_api_key")
        await self.app(scope, receive, send)
