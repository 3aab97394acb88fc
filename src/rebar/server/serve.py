"""Run the app under uvicorn with rebar's connection guards and shutdown semantics."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import resource
import signal
import threading
from collections.abc import Iterator

import h11
import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.h11_impl import H11Protocol

from rebar.config import ServerSettings
from rebar.server.errors import error_body

logger = logging.getLogger("rebar.server")

# Room for the listening socket, log files, model files, Redis and the engine's own descriptors.
_SPARE_FILES = 256


class GuardedH11Protocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol, plus a deadline for each request's headers.

    uvicorn closes idle keep-alive connections but never one that has sent part of a request line
    or headers (any byte cancels its keep-alive timer), so clients that trickle half a header
    could hold every connection. Here a request must complete its headers within
    `header_timeout_s` of its first byte (of the connection, for the first request), else the
    connection gets 408 and is closed. Bodies are timed by BodyLimitMiddleware.
    """

    def __init__(self, *args, header_timeout_s: float, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.header_timeout_s = header_timeout_s
        self._header_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_deadline()

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE:
            # the first bytes of a new request on a kept-alive connection
            self._arm_header_deadline()
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:
            self._disarm_header_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_deadline()
        super().connection_lost(exc)

    def _arm_header_deadline(self) -> None:
        if self._header_deadline is None:  # never re-armed per byte: a trickle must not extend it
            self._header_deadline = self.loop.call_later(
                self.header_timeout_s, self._headers_timed_out
            )

    def _disarm_header_deadline(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _headers_timed_out(self) -> None:
        self._header_deadline = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        message = f"the request headers did not arrive within {self.header_timeout_s:g}s"
        body = json.dumps(error_body(408, message, None, "request_timeout")).encode()
        head = (
            "HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
        ).encode()
        self.transport.write(head + body)
        self.transport.close()


class _Server(uvicorn.Server):
    """uvicorn, except that SIGTERM/SIGINT end in a clean exit 0 after the drain.

    uvicorn re-raises the captured signal once it has shut down, so a service stopped the normal
    way would report death-by-signal to its supervisor.
    """

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        originals = {
            sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)
        }
        try:
            yield
        finally:
            for sig, handler in originals.items():
                signal.signal(sig, handler)


def uvicorn_config(
    app: FastAPI, settings: ServerSettings, log_level: str = "info", port: int | None = None
) -> uvicorn.Config:
    """uvicorn's settings for `settings`: connection limit and header deadline, forwarded headers
    believed only from `trusted_proxies`, and the drain timeout."""
    trusted = list(settings.trusted_proxies)
    # log_config=None: logging is configured by `rebar.obs.logs` (JSON lines); rebar.access replaces
    # uvicorn's access log.
    return uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port if port is None else port,
        log_level=log_level,
        log_config=None,
        access_log=False,
        # The standard event loop whether or not uvloop is installed (Ray Serve brings it): the
        # one rebar is tested and measured on.
        loop="asyncio",
        timeout_graceful_shutdown=int(settings.drain_timeout_s),
        http=functools.partial(GuardedH11Protocol, header_timeout_s=settings.header_timeout_s),  # type: ignore[arg-type]
        limit_concurrency=settings.max_connections,
        proxy_headers=bool(trusted),
        forwarded_allow_ips=trusted or None,
    )


def raise_file_limit(max_connections: int) -> int:
    """Raise the soft open-file limit towards what `max_connections` needs (never above the hard
    limit); returns the soft limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = max_connections + _SPARE_FILES
    if soft != resource.RLIM_INFINITY and soft < wanted:
        target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
    if soft != resource.RLIM_INFINITY and soft < wanted:
        logger.warning(
            "the open-file limit (%d) is below "
            "max_connections + %d; new connections may fail first",
            soft,
            _SPARE_FILES,
        )
    return soft


def run_server(app: FastAPI, settings: ServerSettings, log_level: str) -> None:
    """Serve until SIGTERM/SIGINT; then stop accepting, let in-flight requests finish for up to
    `drain_timeout_s`, stop the engine, and return."""
    raise_file_limit(settings.max_connections)
    _Server(uvicorn_config(app, settings, log_level)).run()
