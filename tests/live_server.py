"""Run rebar's app under a real uvicorn on a free loopback port, in a background thread."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from typing import TypeVar

import httpx
import uvicorn

from waiting import HANG_S, wait_until

T = TypeVar("T")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def live_server(app, wait_ready: bool = True, timeout: float = 120.0, settings=None):
    """Yields the base URL; stops the server (graceful shutdown) on exit.

    With `settings`, uvicorn runs as `rebar serve` configures it (connection guards included).
    """
    port = free_port()
    if settings is None:
        config = uvicorn.Config(
            app, host="127.0.0.1", port=port, log_level="warning", timeout_graceful_shutdown=5
        )
    else:
        from rebar.server.serve import uvicorn_config

        config = uvicorn_config(app, settings.server, "warning", port=port)
    server = uvicorn.Server(config)
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


def server_settings(**overrides):
    """Settings for a test server (dotted keys override): a context and KV cache sized for tests."""
    from rebar.config import load_settings

    base = {
        "engine.max_model_len": 2048,
        "engine.kv_cache_memory": 256 * 2**20,
        "server.drain_timeout_s": 5,
    }
    return load_settings(None, {**base, **overrides})


@contextmanager
def serving_models(served_models, settings):
    """(base URL, app) of a live server on already-loaded models; the app's lifespan stops its
    engine thread."""
    from rebar.engine.async_engine import AsyncEngine
    from rebar.server.app import create_app

    served_models.engine = AsyncEngine(served_models.chat.engine)
    app = create_app(settings, served_models)
    with live_server(app, settings=settings) as url:
        yield url, app


def chat_core(app):
    """The engine core of the app's default chat model (its current version)."""
    registry = app.state.rebar.registry
    return registry.slots[registry.default_name("chat")].current.engine.core


def embedding_model(app):
    """The current version of the app's default embedding model."""
    registry = app.state.rebar.registry
    return registry.slots[registry.default_name("embedding")].current


def engine_idle(app, timeout: float = HANG_S) -> bool:
    """Whether the chat engine reports idle (no unfinished request, every KV block free) within
    `timeout`, which only bounds a hang (tests/waiting.py)."""
    core = chat_core(app)

    def idle() -> bool:
        stats = core.stats()
        return not core.has_unfinished_requests() and stats.num_free_blocks == stats.num_blocks

    return wait_until(idle, timeout)


def assert_idle(app, timeout: float = HANG_S) -> None:
    """Nothing left behind: no admission tickets, no queued embeddings, no requests in the engine,
    every KV block free (blocks that only cache a prefix count as free: they are reusable)."""
    state = app.state.rebar
    deadline = time.monotonic() + timeout
    while True:
        stats = chat_core(app).stats()
        embedding = sum(
            version.queue.num_waiting_inputs
            for version in state.registry.loaded()
            if getattr(version, "queue", None) is not None
        )
        idle = (
            state.gate.waiting.waiting_requests == 0
            and embedding == 0
            and stats.num_running == 0
            and stats.num_waiting == 0
            and stats.num_free_blocks == stats.num_blocks
        )
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert idle, (state.gate.waiting.waiting_requests, embedding, stats)


def slowest_health(url: str, during: Callable[[], T]) -> tuple[float, T]:
    """Run `during()` while another client polls /health; (its slowest answer in seconds, during's
    result)."""
    worst, done = 0.0, threading.Event()

    def poll() -> None:
        nonlocal worst
        with httpx.Client() as client:
            while not done.is_set():
                started = time.monotonic()
                client.get(url + "/health", timeout=30)
                worst = max(worst, time.monotonic() - started)
                time.sleep(0.02)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        result = during()
    finally:
        done.set()
        poller.join()
    return worst, result
