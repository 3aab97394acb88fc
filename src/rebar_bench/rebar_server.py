"""`rebar serve` started as users start it, for the benchmarks that measure it over HTTP."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def rebar_server(
    model: str, threads: int | None = None, ready_timeout_s: float = 600.0
) -> Iterator[str]:
    """Yields the base URL of a `rebar serve --model MODEL` on loopback with every other setting
    at its default (no embedding model, a quiet log, and `threads` torch threads when given);
    stops it on exit."""
    with rebar_server_process(model, threads, ready_timeout_s) as (url, _process):
        yield url


@contextmanager
def rebar_server_process(
    model: str,
    threads: int | None = None,
    ready_timeout_s: float = 600.0,
    env: dict[str, str] | None = None,
) -> Iterator[tuple[str, subprocess.Popen]]:
    """`rebar_server`, also yielding the process; `env` adds REBAR_* settings."""
    port = free_port()
    full_env = {**os.environ, "REBAR_LOGGING__LEVEL": "warning", **(env or {})}
    if threads is not None:
        full_env["REBAR_ENGINE__NUM_THREADS"] = str(threads)
    command = [sys.executable, "-m", "rebar.cli", "serve", "--model", model]
    command += ["--embedding-model", "none", "--port", str(port)]
    # The log goes to a file: a pipe nobody reads would stall a server that logs a lot.
    with tempfile.TemporaryFile() as log:
        server = subprocess.Popen(command, env=full_env, stdout=subprocess.DEVNULL, stderr=log)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + ready_timeout_s
            while True:
                if server.poll() is not None:
                    log.seek(0)
                    stderr = log.read().decode(errors="replace")
                    raise RuntimeError(f"rebar serve exited: {stderr[-2000:]}")
                try:
                    if httpx.get(url + "/ready", timeout=2).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"rebar serve was not ready within {ready_timeout_s:.0f} s")
                time.sleep(0.2)
            yield url, server
        finally:
            server.terminate()
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
