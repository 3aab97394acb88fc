"""ASGI middleware: request ids, body-size limit, API-key auth, HTTP metrics. Pure ASGI so streaming responses pass through."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Awaitable, Callable, Iterator, Sequence

from starlette.routing import BaseRoute, Match

from rebar.obs.logs import bind_request_id, unbind_request_id
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
    """Every response carries X-Request-ID: the client's (when well-formed) or a new one; logs carry it too."""

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

        token = bind_request_id(request_id)
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            unbind_request_id(token)


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


OPEN_PATHS = ("/health", "/ready", "/metrics", "/docs", "/openapi.json", "/docs/oauth2-redirect", "/redoc")


class ApiKeyMiddleware:
    """401 with an OpenAI error body unless `Authorization: Bearer <key>` matches; open paths stay open."""

    def __init__(self, app: ASGIApp, check: Callable[[str | None], bool], open_paths: tuple[str, ...] = OPEN_PATHS) -> None:
        self.app, self.check, self.open_paths = app, check, open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        # /admin/* checks its own, separate keys.
        if scope["type"] != "http" or path in self.open_paths or path == "/" or path.startswith(("/static", "/admin/")):
            return await self.app(scope, receive, send)
        if not self.check(_header(scope, b"authorization")):
            return await send_error(send, 401, "invalid or missing API key (Authorization: Bearer <key>)",
                                    [(b"www-authenticate", b"Bearer")], code="invalid_api_key")
        await self.app(scope, receive, send)


def _flat_routes(routes: Sequence[BaseRoute]) -> Iterator[BaseRoute]:
    for route in routes:
        included = getattr(route, "original_router", None)  # FastAPI wraps included routers
        if included is not None:
            yield from _flat_routes(included.routes)
        elif hasattr(route, "path"):
            yield route


def route_template(routes: Sequence[BaseRoute], scope: Scope) -> str:
    """The matching route's path template ("/v1/chat/completions"), or "other": labels stay bounded."""
    routed = scope.get("route")  # set by the router once it matched
    if routed is not None and hasattr(routed, "path"):
        return routed.path
    partial = None
    for route in _flat_routes(routes):
        match, _ = route.matches(scope)
        if match == Match.FULL:
            return route.path
        if match == Match.PARTIAL and partial is None:  # the path matched but not the method (405)
            partial = route.path
    return partial or "other"


class HTTPMetricsMiddleware:
    """Counts requests by route template, method and status, and times them to the last byte (streams included).

    Outermost, so 401/413 answered by inner middleware are counted too. `arrived_at` (on the
    metrics clock) is left in the request state for TTFT and e2e.
    """

    def __init__(self, app: ASGIApp, metrics, routes: Callable[[], Sequence[BaseRoute]]) -> None:
        self.app, self.metrics, self.routes = app, metrics, routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = self.metrics.clock()
        scope.setdefault("state", {})["arrived_at"] = started
        status = 500  # an exception before the response started

        async def recording_send(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, recording_send)
        finally:
            # After the call, so the router's own match is used; requests answered before routing
            # (401, 413) are matched here.
            route = route_template(self.routes(), scope)
            self.metrics.observe_http(route, scope["method"], status, self.metrics.clock() - started)
