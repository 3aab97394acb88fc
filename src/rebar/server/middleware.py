"""ASGI middleware: request ids, body-size limit, API-key auth, HTTP metrics. Pure ASGI so streaming responses pass through."""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from collections.abc import Awaitable, Callable, Iterator, Sequence

from starlette.routing import BaseRoute, Match

from rebar.obs.logs import bind_request_id, unbind_request_id
from rebar.server.auth import ApiKeyChecker
from rebar.server.errors import error_body

Scope = dict
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

_VALID_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")


async def send_error(
    send: Send,
    status: int,
    message: str,
    headers: list[tuple[bytes, bytes]] | None = None,
    code: str | None = None,
) -> None:
    body = json.dumps(error_body(status, message, None, code)).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *(headers or []),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key == name:
            return value.decode("latin-1")
    return None


class RequestIdMiddleware:
    """Every response carries X-Request-ID: the client's (when well-formed) or a new one; logs carry it too.

    The client's id is only a label. What identifies the request inside rebar (the engine's
    request id, the response's `id`) is `internal_id`, always generated here, so two clients
    that send the same X-Request-ID never see each other's work.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = _header(scope, b"x-request-id")
        request_id = given if given and _VALID_REQUEST_ID.fullmatch(given) else uuid.uuid4().hex
        state = scope.setdefault("state", {})
        state["request_id"], state["internal_id"] = request_id, uuid.uuid4().hex

        async def send_with_id(message: dict) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [
                    *message.get("headers", []),
                    (b"x-request-id", request_id.encode()),
                ]
            await send(message)

        token = bind_request_id(request_id)
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            unbind_request_id(token)


class BodyLimitMiddleware:
    """Reads the whole request body before the app sees it: 413 past `max_bytes` (announced by
    Content-Length or streamed chunked), 408 when it has not all arrived within `timeout_s`.

    Buffering first means the routes never parse a partial body and a slow upload never holds a
    route (or the engine) waiting; later `receive` calls still report the client's disconnect.
    """

    def __init__(self, app: ASGIApp, max_bytes: int, timeout_s: float) -> None:
        self.app, self.max_bytes, self.timeout_s = app, max_bytes, timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = _header(scope, b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await self._too_large(send)
        chunks: list[bytes] = []
        received = 0
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0.0))
            except TimeoutError:
                return await send_error(
                    send,
                    408,
                    f"the request body did not arrive within {self.timeout_s:g}s",
                    [(b"connection", b"close")],
                    code="request_timeout",
                )
            if message["type"] == "http.disconnect":
                return  # the client left before its body arrived: nothing to answer
            chunk = message.get("body", b"")
            received += len(chunk)
            if received > self.max_bytes:
                return await self._too_large(send)
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(b"".join(chunks), receive), send)

    async def _too_large(self, send: Send) -> None:
        # Connection: close, since the rest of the body is never read.
        await send_error(
            send,
            413,
            f"request body exceeds {self.max_bytes} bytes",
            [(b"connection", b"close")],
            code="body_too_large",
        )


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that hands over the buffered body once, then waits on the client (for its disconnect)."""
    delivered = False

    async def replay() -> dict:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


class AdminKeyMiddleware:
    """/admin/*: 403 while no admin key is configured, 401 unless `Authorization: Bearer <admin key>`.

    Checked before the body is parsed, so a caller without the key learns nothing about the endpoint.
    """

    def __init__(self, app: ASGIApp, checker: ApiKeyChecker) -> None:
        self.app, self.checker = app, checker

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope.get("path", "").startswith("/admin/"):
            return await self.app(scope, receive, send)
        if not self.checker.enabled:
            return await send_error(
                send,
                403,
                "admin endpoints are disabled; set server.admin_api_keys to enable them",
                code="admin_disabled",
            )
        if self.checker.matching_digest(_header(scope, b"authorization")) is None:
            return await _refuse_key(send, "admin key (Authorization: Bearer <admin key>)")
        await self.app(scope, receive, send)


OPEN_PATHS = (
    "/health",
    "/ready",
    "/metrics",
    "/docs",
    "/openapi.json",
    "/docs/oauth2-redirect",
    "/redoc",
)


class ApiKeyMiddleware:
    """401 with an OpenAI error body unless `Authorization: Bearer <key>` matches; open paths stay open.

    The matched key, as `api_key_id` in the request state, is the caller's identity for rate
    limits and cache isolation.
    """

    def __init__(
        self, app: ASGIApp, checker: ApiKeyChecker, open_paths: tuple[str, ...] = OPEN_PATHS
    ) -> None:
        self.app, self.checker, self.open_paths = app, checker, open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        # /admin/* checks its own, separate keys.
        if (
            scope["type"] != "http"
            or path in self.open_paths
            or path == "/"
            or path.startswith(("/static", "/admin/"))
        ):
            return await self.app(scope, receive, send)
        digest = self.checker.matching_digest(_header(scope, b"authorization"))
        if digest is None:
            return await _refuse_key(send, "API key (Authorization: Bearer <key>)")
        scope.setdefault("state", {})["api_key_id"] = api_key_id(digest)
        await self.app(scope, receive, send)


def api_key_id(digest: str) -> str:
    """A stable, non-secret name for a key, from its SHA-256 digest (as `rate_limits.per_key` names keys)."""
    return "key-" + digest[:32]


async def _refuse_key(send: Send, what: str) -> None:
    await send_error(
        send,
        401,
        f"invalid or missing {what}",
        [(b"www-authenticate", b"Bearer")],
        code="invalid_api_key",
    )


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
            self.metrics.observe_http(
                route, method_label(scope["method"]), status, self.metrics.clock() - started
            )


HTTP_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"})


def method_label(method: str) -> str:
    """The request method for a metric label; any other token a client makes up is "other"."""
    return method if method in HTTP_METHODS else "other"
