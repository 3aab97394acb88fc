"""Run rebar's app under a real uvicorn on a free loopback port, in a background thread."""

from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager

import httpx
import uvicorn


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def live_server(app, wait_ready: bool = True, timeout: float = 120.0):
    """Yields the base URL; stops the server (graceful shutdown) on exit."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    path = "/ready" if wait_ready else "/health"
    while True:
        try:
            if httpx.get(url + path, timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            server.should_exit = True
            raise RuntimeError(f"server did not become {path} in {timeout}s")
        time.sleep(0.05)
    try:
        yield url
    finally:
        server.should_exit = True
        thread.join(30)
