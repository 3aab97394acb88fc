"""ResilientStore: deadlines, fallbacks and the circuit breaker, on a scripted backend and on a
real redis-server that is killed and restarted."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Iterator

import pytest

from rebar.store import MemoryStore, RateDecision, ResilientStore, StoreError
from waiting import HANG_S


class FlakyStore(MemoryStore):
    """A MemoryStore that can be made to fail (`down`, raising `error`) or stall (`delay_s`);
    counts calls."""

    def __init__(self) -> None:
        super().__init__()
        self.down = False
        self.error: Exception = StoreError("backend down")
        self.delay_s = 0.0
        self.num_calls = 0

    async def _enter(self) -> None:
        self.num_calls += 1
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if self.down:
            raise self.error

    async def get(self, key):  # type: ignore[override]
        await self._enter()
        return await super().get(key)

    async def set(self, key, value, ttl_ms=None):  # type: ignore[override]
        await self._enter()
        await super().set(key, value, ttl_ms)

    async def set_if_absent(self, key, value, ttl_ms=None):  # type: ignore[override]
        await self._enter()
        return await super().set_if_absent(key, value, ttl_ms)

    async def delete(self, key):  # type: ignore[override]
        await self._enter()
        await super().delete(key)

    async def ttl_ms(self, key):  # type: ignore[override]
        await self._enter()
        return await super().ttl_ms(key)

    async def rate_limit(self, key, cost, limit, window_ms, *, clamp=False):  # type: ignore[override]
        await self._enter()
        return await super().rate_limit(key, cost, limit, window_ms, clamp=clamp)

    async def publish(self, channel, message):  # type: ignore[override]
        await self._enter()
        return await super().publish(channel, message)

    async def subscribe(self, channel):  # type: ignore[override]
        await self._enter()
        return await super().subscribe(channel)

    async def ping(self) -> bool:
        await self._enter()
        return True


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def warnings_from_store(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "rebar.store" and r.levelno >= logging.WARNING]


@pytest.mark.parametrize("on_error", ["allow", "deny"])
def test_every_call_falls_back_when_the_backend_fails(on_error: str) -> None:
    async def main() -> None:
        inner = FlakyStore()
        inner.down = True
        store = ResilientStore(inner, failure_threshold=100, on_error=on_error)  # type: ignore[arg-type]
        assert await store.get("k") is None
        assert await store.set("k", b"v", 1000) is None
        assert await store.set_if_absent("lock", b"1", 1000) is True
        assert await store.delete("k") is None
        assert await store.ttl_ms("k") is None
        decision = await store.rate_limit("rl", 1, 7, 60_000)
        if on_error == "allow":
            assert decision == RateDecision(allowed=True, remaining=7, reset_ms=0)
        else:
            assert not decision.allowed and decision.remaining == 0 and decision.reset_ms > 0
        assert store.num_errors == 6 and inner.num_calls == 6 and not store.circuit_open

    asyncio.run(main())


def test_circuit_opens_after_threshold_then_half_opens() -> None:
    clock = Clock()

    async def main() -> None:
        inner = FlakyStore()
        store = ResilientStore(inner, failure_threshold=3, open_for_s=5, clock=clock)
        await store.set("k", b"v")
        inner.down = True
        for _ in range(2):
            assert await store.get("k") is None
        assert not store.circuit_open and store.state == "closed"
        assert await store.get("k") is None
        assert store.circuit_open and store.state == "open" and store.num_errors == 3
        for _ in range(4):
            assert await store.get("k") is None
        assert inner.num_calls == 4 and store.num_short_circuited == 4  # the backend was left alone

        clock.now += 5
        assert store.state == "half_open"
        assert await store.get("k") is None  # the trial fails: open again
        assert inner.num_calls == 5 and store.state == "open"
        assert await store.get("k") is None
        assert inner.num_calls == 5

        clock.now += 5
        inner.down = False
        assert await store.get("k") == b"v"  # the trial succeeds: closed
        assert store.state == "closed" and not store.circuit_open
        assert await store.get("k") == b"v" and inner.num_calls == 7

    asyncio.run(main())


def test_success_resets_the_consecutive_failure_count() -> None:
    async def main() -> None:
        inner = FlakyStore()
        store = ResilientStore(inner, failure_threshold=3)
        for _ in range(5):
            inner.down = True
            await store.get("k")
            await store.get("k")
            inner.down = False
            await store.get("k")
        assert store.num_errors == 10 and not store.circuit_open

    asyncio.run(main())


def test_half_open_lets_exactly_one_trial_through() -> None:
    clock = Clock()

    async def main() -> None:
        inner = FlakyStore()
        store = ResilientStore(inner, failure_threshold=1, open_for_s=1, clock=clock)
        inner.down = True
        await store.get("k")
        assert store.circuit_open
        clock.now += 1
        inner.down = False
        inner.delay_s = 0.05
        results = await asyncio.gather(*(store.set_if_absent("lock", b"x", 1000) for _ in range(5)))
        assert inner.num_calls == 2  # the first failure, then a single trial
        assert results.count(True) == 5  # the trial won the lock; the rest got the fallback
        assert not store.circuit_open

    asyncio.run(main())


def test_cancelled_trial_frees_the_trial_slot() -> None:
    clock = Clock()

    async def main() -> None:
        inner = FlakyStore()
        store = ResilientStore(
            inner, failure_threshold=1, open_for_s=1, call_timeout_s=5, clock=clock
        )
        inner.down = True
        await store.get("k")
        clock.now += 1
        inner.down, inner.delay_s = False, 10
        trial = asyncio.create_task(store.get("k"))
        await asyncio.sleep(0.01)
        trial.cancel()
        with pytest.raises(asyncio.CancelledError):
            await trial
        inner.delay_s = 0
        await store.set("k", b"v")  # admitted as the next trial
        assert await store.get("k") == b"v" and not store.circuit_open

    asyncio.run(main())


def test_slow_backend_times_out_to_the_fallback() -> None:
    async def main() -> None:
        inner = FlakyStore()
        inner.delay_s = 3600  # the backend never answers: only the call timeout can end a call
        store = ResilientStore(inner, call_timeout_s=0.1, on_error="deny")
        assert await _answered(store.get("k")) is None
        assert not (await _answered(store.rate_limit("rl", 1, 10, 1000))).allowed
        assert store.num_errors == 2
        assert await store.ping() is False

    asyncio.run(main())


def test_failures_are_logged_once_per_interval(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    caplog.set_level(logging.INFO, logger="rebar.store")

    async def main() -> None:
        inner = FlakyStore()
        inner.down = True
        store = ResilientStore(inner, failure_threshold=3, open_for_s=5, clock=clock)
        for _ in range(20):
            await store.get("k")
        assert len(warnings_from_store(caplog)) == 1
        assert "backend down" in warnings_from_store(caplog)[0].getMessage()
        clock.now += 5
        await store.get("k")  # failed trial, a new interval: logged again
        assert len(warnings_from_store(caplog)) == 2
        clock.now += 5
        inner.down = False
        await store.get("k")
        assert any("recovered" in r.getMessage() for r in caplog.records if r.name == "rebar.store")

    asyncio.run(main())


def test_invalid_arguments_raise_even_when_open() -> None:
    async def main() -> None:
        inner = FlakyStore()
        inner.down = True
        store = ResilientStore(inner, failure_threshold=1)
        await store.get("k")
        assert store.circuit_open
        with pytest.raises(ValueError):
            await store.set("k", b"v", ttl_ms=0)
        with pytest.raises(TypeError):
            await store.set_if_absent("k", "v")  # type: ignore[arg-type]
        with pytest.raises(ValueError):
            await store.rate_limit("rl", -1, 10, 1000)
        with pytest.raises(ValueError):
            ResilientStore(inner, on_error="maybe")  # type: ignore[arg-type]

    asyncio.run(main())


async def _answered(awaitable):
    """The awaitable's result; a hang (no fallback, no timeout) fails at HANG_S."""
    return await asyncio.wait_for(awaitable, HANG_S)


def test_redis_killed_then_restarted(own_redis_server, caplog: pytest.LogCaptureFixture) -> None:
    from rebar.store import RedisStore

    server = own_redis_server
    caplog.set_level(logging.WARNING, logger="rebar.store")

    async def main() -> None:
        inner = RedisStore(server.url)
        allow = ResilientStore(
            inner, call_timeout_s=0.25, failure_threshold=3, open_for_s=0.5, on_error="allow"
        )
        deny = ResilientStore(
            inner, call_timeout_s=0.25, failure_threshold=3, open_for_s=0.5, on_error="deny"
        )
        await allow.set("k", b"v")
        assert await allow.get("k") == b"v"
        assert (await deny.rate_limit("rl", 1, 5, 60_000)).allowed

        server.kill()
        assert await _answered(allow.get("k")) is None
        assert await _answered(allow.set("k", b"w")) is None
        assert await _answered(allow.set_if_absent("lock", b"1", 1000)) is True
        assert allow.circuit_open and allow.num_errors == 3
        assert await _answered(allow.delete("k")) is None
        assert await _answered(allow.ttl_ms("k")) is None
        assert await _answered(allow.rate_limit("rl", 1, 5, 60_000)) == RateDecision(True, 5, 0)
        assert allow.num_short_circuited == 3 and allow.num_errors == 3
        assert len(warnings_from_store(caplog)) == 1
        for _ in range(3):
            assert not (await _answered(deny.rate_limit("rl", 1, 5, 60_000))).allowed
        assert deny.circuit_open
        assert await _answered(allow.ping()) is False

        server.restart()  # same port, empty data
        await asyncio.sleep(0.55)
        assert await allow.get("k") is None  # the trial reaches the new server
        assert not allow.circuit_open
        await allow.set("k", b"back")
        assert await allow.get("k") == b"back"
        assert (await deny.rate_limit("rl", 1, 5, 60_000)).remaining == 4
        assert not deny.circuit_open and await allow.ping() is True
        await allow.close()

    asyncio.run(main())
    assert server.cli("GET", "k") == "back"


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port that accepts TCP connections and never answers, like a hung server."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        yield listener.getsockname()[1]


def test_hung_redis_times_out_to_fallbacks(silent_port: int) -> None:
    from rebar.store import RedisStore

    async def main() -> None:
        inner = RedisStore(f"redis://127.0.0.1:{silent_port}/0", socket_timeout_s=5)
        store = ResilientStore(inner, call_timeout_s=0.2, failure_threshold=2, open_for_s=30)
        assert await _answered(store.get("k")) is None
        assert await _answered(store.set_if_absent("lock", b"1", 1000)) is True
        assert store.circuit_open and store.num_errors == 2
        assert (await _answered(store.rate_limit("rl", 1, 5, 60_000))).allowed
        await store.close()

    asyncio.run(main())


def test_publish_falls_back_to_nobody_reached() -> None:
    async def main() -> None:
        inner = FlakyStore()
        store = ResilientStore(inner, failure_threshold=2, open_for_s=30)
        sub = await store.subscribe("events")
        assert await store.publish("events", b"up") == 1
        inner.down = True
        assert await store.publish("events", b"lost") == 0
        assert await store.publish("events", b"lost") == 0
        assert store.circuit_open and store.num_errors == 2
        calls = inner.num_calls
        assert await store.publish("events", b"short-circuited") == 0
        assert inner.num_calls == calls and store.num_short_circuited == 1
        with pytest.raises(TypeError):
            await store.publish("events", "text")  # type: ignore[arg-type]
        assert await asyncio.wait_for(anext(sub), 5) == b"up"
        await store.close()
        with pytest.raises(StopAsyncIteration):
            await anext(sub)

    asyncio.run(main())


def test_slow_publish_times_out_to_zero() -> None:
    async def main() -> None:
        inner = FlakyStore()
        inner.delay_s = 5
        store = ResilientStore(inner, call_timeout_s=0.1)
        assert await _answered(store.publish("events", b"m")) == 0
        assert store.num_errors == 1

    asyncio.run(main())


def test_subscribe_passes_through_the_circuit() -> None:
    async def main() -> None:
        inner = FlakyStore()
        store = ResilientStore(inner, failure_threshold=1, open_for_s=30)
        inner.down = True
        await store.get("k")
        assert store.circuit_open
        with pytest.raises(StoreError, match="backend down"):  # no fallback: raised
            await store.subscribe("events")
        inner.error = ConnectionRefusedError("refused")
        with pytest.raises(StoreError, match="ConnectionRefusedError"):  # wrapped
            await store.subscribe("events")
        assert store.num_errors == 1 and store.num_short_circuited == 0  # the circuit is not told

        inner.down = False
        sub = await store.subscribe("events")  # the circuit is still open: subscribe goes through
        assert store.circuit_open and inner.num_calls == 4
        assert await inner.publish("events", b"direct") == 1
        assert await asyncio.wait_for(anext(sub), 5) == b"direct"
        await sub.close()

        inner.delay_s = 3600  # never answers: the subscribe's own timeout must end it
        with pytest.raises(StoreError, match="timed out"):
            await _answered(store.subscribe("events"))

    asyncio.run(main())


def test_redis_killed_under_pubsub(own_redis_server) -> None:
    from rebar.store import RedisStore

    server = own_redis_server

    async def main() -> None:
        store = ResilientStore(RedisStore(server.url), failure_threshold=3, open_for_s=30)
        sub = await store.subscribe("events")
        assert await store.publish("events", b"up") == 1
        assert await asyncio.wait_for(anext(sub), 5) == b"up"
        waiting = asyncio.create_task(anext(sub))
        await asyncio.sleep(0.05)

        server.kill()
        with pytest.raises(StoreError):  # the subscription is the backend's: its loss is raised
            await asyncio.wait_for(waiting, 3)
        assert await _answered(store.publish("events", b"lost")) == 0
        with pytest.raises(StoreError):  # refused at once: a hang fails at HANG_S
            await _answered(store.subscribe("events"))

        server.restart()
        again = await store.subscribe("events")
        assert server.cli("PUBLISH", "events", "back") == "1"
        assert await asyncio.wait_for(anext(again), 5) == b"back"
        await store.close()

    asyncio.run(main())
