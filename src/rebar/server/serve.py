"""Run the app under uvicorn with rebar's shutdown semantics."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

import uvicorn
from fastapi import FastAPI


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
        originals = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in originals.items():
                signal.signal(sig, handler)


def run_server(app: FastAPI, host: str, port: int, drain_timeout_s: float, log_level: str) -> None:
    """Serve until SIGTERM/SIGINT; then stop accepting, let in-flight requests finish for up to
    `drain_timeout_s`, stop the engine, and return."""
    # log_config=None: logging is configured by `rebar.obs.logs` (JSON lines); rebar.access replaces uvicorn's access log.
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, log_config=None, access_log=False,
                            timeout_graceful_shutdown=int(drain_timeout_s))
    _Server(config).run()
