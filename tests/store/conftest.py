"""Store fixtures: a real redis-server per session (and a private one for tests that kill it),
and `backend`, which runs a test once over `memory` and once over `redis`."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import pytest

from rebar.store import MemoryStore, Store
from redis_server import RedisServer, running_redis_server

T = TypeVar("T")


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """A redis-server shared by the session; tests must not stop it (use `own_redis_server`)."""
    yield from running_redis_server()


@pytest.fixture
def own_redis_server() -> Iterator[RedisServer]:
    """A redis-server for one test, which may kill and restart it."""
    yield from running_redis_server()


@dataclass
class Backend:
    """How to open a fresh client of the backend under test; `server` is None for memory."""

    name: str
    make: Callable[[], Store]
    server: RedisServer | None = None

    def run(self, body: Callable[[Store], Awaitable[T]]) -> T:
        """Open a store inside a fresh event loop, run `body` with it, close it."""

        async def main() -> T:
            store = self.make()
            try:
                return await body(store)
            finally:
                await store.close()

        return asyncio.run(main())


@pytest.fixture(params=["memory", "redis"])
def backend(request: pytest.FixtureRequest) -> Backend:
    if request.param == "memory":
        shared = MemoryStore()
        return Backend("memory", lambda: shared)
    from rebar.store import RedisStore

    server: RedisServer = request.getfixturevalue("redis_server")
    server.cli("FLUSHALL")
    # A generous socket timeout: these tests are about semantics, and a slow CI machine opening
    # dozens of connections at once must not turn into timeouts.
    return Backend("redis", lambda: RedisStore(server.url, socket_timeout_s=2.0), server)
