"""ASGI middleware for traces and the access log (pure ASGI, so streams pass through untouched).

Both wrap the whole response, streaming included: the server span and the access-log line end
when the last byte is sent (or the client leaves).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode, Tracer
from starlette.routing import BaseRoute

from rebar.obs.tracing import extract_context, trace_id_of
from rebar.server.context import request_context
from rebar.server.middleware import ASGIApp, Receive, Scope, Send, route_template

access_logger = logging.getLogger("rebar.access")


def _headers(scope: Scope) -> dict[str, str]:
    return {
        key.decode("latin-1"): value.decode("latin-1") for key, value in scope.get("headers", [])
    }


class TracingMiddleware:
    """One server span per HTTP request, continuing a W3C `traceparent`; answers carry `X-Trace-ID`.

    The span is current while the app runs, so spans the routes open (cache lookup, rate limit,
    generate, store calls) become its children.
    """

    def __init__(
        self, app: ASGIApp, tracer: Tracer, routes: Callable[[], Sequence[BaseRoute]]
    ) -> None:
        self.app, self.tracer, self.routes = app, tracer, routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        method = scope["method"]
        span = self.tracer.start_span(
            f"HTTP {method}",
            context=extract_context(_headers(scope)),
            kind=SpanKind.SERVER,
            attributes={"http.request.method": method, "url.path": scope["path"]},
        )
        trace_id = trace_id_of(span)
        status = 500

        async def traced_send(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                if trace_id:
                    message["headers"] = [
                        *message.get("headers", []),
                        (b"x-trace-id", trace_id.encode()),
                    ]
            await send(message)

        token = otel_context.attach(trace.set_span_in_context(span))
        try:
            await self.app(scope, receive, traced_send)
        except Exception as exc:
            span.record_exception(exc)
            raise
        finally:
            route = route_template(self.routes(), scope)
            span.update_name(f"{method} {route}")
            span.set_attribute("http.route", route)
            span.set_attribute("http.response.status_code", status)
            request_id = request_context(scope).request_id
            if request_id:
                span.set_attribute("rebar.request_id", request_id)
            if status >= 500:
                span.set_status(Status(StatusCode.ERROR, f"HTTP {status}"))
            span.end()
            otel_context.detach(token)


class AccessLogMiddleware:
    """One `rebar.access` record per request: route, status, duration, token counts, cache result.

    Routes leave what they know in the request context's `log` (token counts; prompt and
    completion text only when `log_prompts` is on, and they check that themselves).
    """

    def __init__(
        self, app: ASGIApp, routes: Callable[[], Sequence[BaseRoute]], clock: Callable[[], float]
    ) -> None:
        self.app, self.routes, self.clock = app, routes, clock

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = self.clock()
        status, cache = 500, None

        async def logging_send(message: dict) -> None:
            nonlocal status, cache
            if message["type"] == "http.response.start":
                status = message["status"]
                cache = next(
                    (v.decode() for k, v in message.get("headers", []) if k.lower() == b"x-cache"),
                    None,
                )
            await send(message)

        try:
            await self.app(scope, receive, logging_send)
        finally:
            fields = {
                "method": scope["method"],
                "route": route_template(self.routes(), scope),
                "status": status,
                "duration_ms": round((self.clock() - started) * 1e3, 2),
            }
            if cache:
                fields["cache"] = cache
            fields.update(request_context(scope).log)
            # 500: a fault of ours. 503/504 (loading, overloaded, timed out) are expected under
            # load.
            level = (
                logging.ERROR
                if status == 500
                else logging.WARNING
                if status >= 500
                else logging.INFO
            )
            access_logger.log(
                level,
                "%s %s %d",
                scope["method"],
                fields["route"],
                status,
                extra={"fields": fields},
            )
