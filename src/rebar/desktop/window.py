"""One desktop window: its server started first, the window opened on a placeholder at once, the
chat page loaded as soon as the server answers, and the server stopped when the window closes."""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rebar.desktop.backend import GUI, web_view
from rebar.desktop.errors import DesktopError
from rebar.desktop.server import EmbeddedServer

# What the window shows while its server starts (a blank window would look hung).
STARTING_PAGE = (
    "<!doctype html><title>rebar</title><body style='font:16px system-ui,sans-serif;"
    "display:grid;place-items:center;height:90vh;color:#444'><p>Starting rebar…</p></body>"
)
SERVER_START_TIMEOUT_S = 120.0  # the server answers before its model loads: seconds, not minutes

# Code that drives the open window (a test, a kiosk script): called in pywebview's worker thread
# once the chat page has loaded, with the window and its server; the window closes when it returns.
Driver = Callable[[Any, EmbeddedServer], None]


def say(message: str) -> None:
    """A progress line on stderr (the server's own log goes there too)."""
    print(f"rebar desktop: {message}", file=sys.stderr, flush=True)


@dataclass
class WindowOptions:
    """What `rebar desktop` opens."""

    title: str = "rebar"
    width: int = 1100
    height: int = 800


@dataclass
class _Run:
    """What the worker thread reports back to the main thread."""

    started: float = field(default_factory=time.monotonic)
    page_loaded: threading.Event = field(default_factory=threading.Event)
    closed: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None

    def elapsed(self) -> str:
        return f"{time.monotonic() - self.started:.2f}s"


def run_window(
    server: EmbeddedServer, options: WindowOptions, driver: Driver | None = None
) -> None:
    """Open the window on `server` and block until it closes; the server is stopped in every case
    (closed window, SIGTERM/SIGINT, an error). DesktopError when the window or server failed."""
    webview = web_view()  # before the server starts: a missing backend costs nothing
    run = _Run()
    server.start()
    try:
        say(f"server starting on {server.base_url} (pid {server.pid})")
        window = webview.create_window(
            options.title, html=STARTING_PAGE, width=options.width, height=options.height
        )
        window.events.shown += lambda: say(f"window shown after {run.elapsed()}")
        window.events.loaded += lambda: _note_load(window, server, run)
        window.events.closed += run.closed.set
        _close_on_signals(window)
        webview.start(_serve_page, (window, server, run, driver), gui=GUI, private_mode=True)
    finally:
        run.closed.set()  # before the server stops: its exit is then no error of the worker's
        code = server.stop()
        say(f"window closed; server stopped (exit code {code})")
    if run.error is not None:
        if isinstance(run.error, DesktopError):
            raise run.error
        raise DesktopError(f"the window's driver failed: {run.error!r}") from run.error


def _note_load(window: Any, server: EmbeddedServer, run: _Run) -> None:
    if (
        str(window.get_current_url() or "").startswith(server.base_url)
        and not run.page_loaded.is_set()
    ):
        say(f"chat page loaded after {run.elapsed()}")
        run.page_loaded.set()


def _serve_page(window: Any, server: EmbeddedServer, run: _Run, driver: Driver | None) -> None:
    """pywebview's worker thread: wait for the server, load the page, wait for the model, hand
    the window to `driver`, then watch the server until the window closes."""
    try:
        server.wait_until_answering(SERVER_START_TIMEOUT_S)
        say(f"server answering after {run.elapsed()}")
        window.load_url(server.page_url)
        failure = server.wait_until_ready(run.closed)
        if failure is not None:  # the page lists the model as failed; the terminal says why
            say(f"the model failed to load: {failure}")
        elif not run.closed.is_set():
            say(f"model ready after {run.elapsed()}")
        if driver is not None:
            if not run.page_loaded.wait(SERVER_START_TIMEOUT_S):
                raise DesktopError("the chat page did not load in the window")
            driver(window, server)
            window.destroy()
        server.wait_for_exit(run.closed)  # a server that dies takes its window with it
    except BaseException as exc:  # reported by run_window once the window is gone
        if not run.closed.is_set():  # else the window closed first and stopped the server itself
            run.error = exc
            window.destroy()


def _close_on_signals(window: Any) -> None:
    """SIGTERM and SIGINT close the window, so the usual path stops the server."""

    def close(signum: int, _frame: object) -> None:
        say(f"{signal.Signals(signum).name}: closing the window")
        window.destroy()

    signal.signal(signal.SIGTERM, close)
    signal.signal(signal.SIGINT, close)
