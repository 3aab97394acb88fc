"""Publish/subscribe: the same contract over `memory` and a real Redis, then what only one backend
does (the memory queue's bound; Redis across two clients, idle connections, a dead server)."""

from __future__ import annotations

import asyncio
import logging
import signal
from typing import TYPE_CHECKING

import pytest

from rebar.store import MemoryStore, Store, StoreError, Subscription
from redis_server import free_port
from waiting import HANG_S

if TYPE_CHECKING:
    from conftest import Backend  # the fixture's type; annotations only

WAIT_S = 5.0  # generous: a message that takes this long has been lost


async def receive(sub: Subscription, count: int) -> list[bytes]:
    """The next `count` messages, failing the test instead of hanging when they do not come."""

    async def take() -> list[bytes]:
        return [await anext(sub) for _ in range(count)]

    return await asyncio.wait_for(take(), WAIT_S)


async def assert_silent(sub: Subscription, quiet_s: float = 0.2) -> None:
    """Nothing more arrives on `sub` for `quiet_s`."""
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(anext(sub), quiet_s)


def test_every_subscriber_gets_every_message_in_order(backend: Backend) -> None:
    async def body(store: Store) -> None:
        assert await store.publish("events", b"nobody listens") == 0
        first, second = await store.subscribe("events"), await store.subscribe("events")
        assert isinstance(first, Subscription)
        messages = [b"reload 1", b"\x00\xff binary", b"reload 3"]
        for message in messages:
            assert await store.publish("events", message) == 2
        assert await receive(first, 3) == messages
        assert await receive(second, 3) == messages
        await first.close()
        await second.close()

    backend.run(body)


def test_channels_are_separate_and_nothing_comes_from_before_subscribe(backend: Backend) -> None:
    async def body(store: Store) -> None:
        await store.publish("a", b"too early")
        sub_a, sub_b = await store.subscribe("a"), await store.subscribe("b")
        assert await store.publish("b", b"for b") == 1
        assert await store.publish("a", b"for a") == 1
        assert await store.publish("c", b"for nobody") == 0
        assert await receive(sub_a, 1) == [b"for a"]
        assert await receive(sub_b, 1) == [b"for b"]
        await assert_silent(sub_a)
        await assert_silent(sub_b)
        await sub_a.close()
        await sub_b.close()

    backend.run(body)


def test_close_ends_iteration_and_stops_counting(backend: Backend) -> None:
    async def body(store: Store) -> None:
        leaving, staying = await store.subscribe("events"), await store.subscribe("events")

        async def read_all() -> list[bytes]:
            return [message async for message in leaving]

        reader = asyncio.create_task(read_all())
        assert await store.publish("events", b"one") == 2
        await asyncio.sleep(0.05)  # let the reader take "one" and wait for more
        await leaving.close()
        assert await asyncio.wait_for(reader, WAIT_S) == [b"one"]
        assert await store.publish("events", b"two") == 1
        await leaving.close()  # idempotent
        assert [message async for message in leaving] == []
        with pytest.raises(StopAsyncIteration):
            await anext(leaving)
        assert await receive(staying, 2) == [b"one", b"two"]

        async with staying:
            pass
        assert await store.publish("events", b"three") == 0
        async with await store.subscribe("events") as sub:
            assert await store.publish("events", b"four") == 1
            assert await receive(sub, 1) == [b"four"]
        assert await store.publish("events", b"five") == 0

    backend.run(body)


def test_publish_takes_bytes_only(backend: Backend) -> None:
    async def body(store: Store) -> None:
        sub = await store.subscribe("events")
        with pytest.raises(TypeError):
            await store.publish("events", "not bytes")  # type: ignore[arg-type]
        await assert_silent(sub, 0.1)
        await sub.close()

    backend.run(body)


def test_closing_the_store_closes_its_subscriptions(backend: Backend) -> None:
    async def main() -> None:
        store = backend.make()
        sub = await store.subscribe("events")
        reader = asyncio.create_task(anext(sub))
        await asyncio.sleep(0.05)
        await store.close()
        with pytest.raises(StopAsyncIteration):
            await asyncio.wait_for(reader, WAIT_S)

    asyncio.run(main())


def test_memory_subscription_drops_the_oldest_when_full(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="rebar.store")

    async def main() -> None:
        store = MemoryStore(max_pending_messages=3)
        sub = await store.subscribe("events")
        for i in range(5):
            assert await store.publish("events", str(i).encode()) == 1
        assert await receive(sub, 3) == [b"2", b"3", b"4"]
        for i in range(5, 10):
            await store.publish("events", str(i).encode())
        assert await receive(sub, 3) == [b"7", b"8", b"9"]
        assert sub.num_dropped == 4  # type: ignore[attr-defined]
        warnings = [r for r in caplog.records if r.name == "rebar.store"]
        assert len(warnings) == 1 and "dropping the oldest" in warnings[0].getMessage()
        with pytest.raises(ValueError):
            MemoryStore(max_pending_messages=0)
        await store.close()

    asyncio.run(main())


def test_memory_close_forgets_the_channel() -> None:
    async def main() -> None:
        store = MemoryStore()
        async with await store.subscribe("events"):
            assert list(store._subscriptions) == ["events"]
        assert store._subscriptions == {}

    asyncio.run(main())


# Redis only


def test_a_message_crosses_two_redis_stores(redis_server) -> None:
    """Two stores with their own pools and connections stand in for two server processes."""
    from rebar.store import RedisStore

    async def main() -> None:
        one, other = (RedisStore(redis_server.url, socket_timeout_s=2.0) for _ in range(2))
        try:
            here, there = await one.subscribe("reload"), await other.subscribe("reload")
            assert await other.publish("reload", b"model-a v2") == 2
            assert await one.publish("reload", b"model-b v7") == 2
            expected = [b"model-a v2", b"model-b v7"]
            assert await receive(here, 2) == expected
            assert await receive(there, 2) == expected
            assert redis_server.cli("PUBSUB", "NUMSUB", "reload").split() == ["reload", "2"]
        finally:
            await one.close()
            await other.close()
        assert redis_server.cli("PUBSUB", "NUMSUB", "reload").split() == ["reload", "0"]

    asyncio.run(main())


def test_redis_subscriptions_outlast_the_socket_timeout_and_leave_the_pool_alone(
    redis_server,
) -> None:
    from rebar.store import RedisStore

    async def main() -> None:
        # One pooled connection that a call waits for at most a millisecond (so a busy one fails
        # the call rather than delaying it), a 0.25 s socket timeout and frequent health PINGs.
        store = RedisStore(
            redis_server.url, max_connections=1, pool_timeout_s=0.001, subscription_ping_s=0.1
        )
        try:
            subs = [await store.subscribe("idle") for _ in range(3)]
            await asyncio.sleep(0.8)  # idle for three socket timeouts and several PINGs
            await store.set("k", b"v")  # the pool's one connection is still free
            assert await store.get("k") == b"v"
            assert await store.publish("idle", b"still here") == 3
            for sub in subs:
                assert await receive(sub, 1) == [b"still here"]
        finally:
            await store.close()

    asyncio.run(main())


@pytest.mark.parametrize("how", ["kill", "stop", "hang"])
def test_a_dead_redis_ends_a_waiting_iteration_with_store_error(own_redis_server, how) -> None:
    from rebar.store import RedisStore

    server = own_redis_server

    async def main() -> None:
        store = RedisStore(server.url, subscription_ping_s=0.5)
        try:
            sub = await store.subscribe("events")
            assert await store.publish("events", b"before") == 1
            assert await receive(sub, 1) == [b"before"]
            reader = asyncio.create_task(anext(sub))
            await asyncio.sleep(0.1)  # the reader is waiting
            if how == "kill":
                server.kill()
            elif how == "stop":
                await asyncio.to_thread(server.stop)
            else:  # the process stays and keeps its socket open, but answers nothing
                server.process.send_signal(signal.SIGSTOP)
            with pytest.raises(StoreError):  # within about 2 pings; a reader left waiting hangs
                await asyncio.wait_for(reader, HANG_S)
            with pytest.raises(StoreError):  # the failure sticks until the caller closes it
                await asyncio.wait_for(anext(sub), WAIT_S)
            await sub.close()
            with pytest.raises(StopAsyncIteration):
                await anext(sub)
        finally:
            if how == "hang":
                server.process.send_signal(signal.SIGCONT)
            await store.close()

    asyncio.run(main())


def test_messages_received_before_a_loss_are_read_first(own_redis_server) -> None:
    from rebar.store import RedisStore

    server = own_redis_server

    async def main() -> None:
        store = RedisStore(server.url)
        try:
            sub = await store.subscribe("events")
            for message in (b"1", b"2"):
                await store.publish("events", message)
            await asyncio.sleep(0.2)
            server.kill()
            assert await receive(sub, 2) == [b"1", b"2"]
            with pytest.raises(StoreError):
                await asyncio.wait_for(anext(sub), WAIT_S)
            with pytest.raises(StoreError):
                await store.publish("events", b"3")
        finally:
            await store.close()

    asyncio.run(main())


def test_redis_subscribe_to_an_unreachable_server_fails_fast() -> None:
    from rebar.store import RedisStore

    async def main() -> None:
        # A connect timeout beyond the hang bound: only the refused connection can fail it in time.
        store = RedisStore(f"redis://127.0.0.1:{free_port()}/0", socket_timeout_s=2 * HANG_S)
        try:
            with pytest.raises(StoreError):
                await asyncio.wait_for(store.subscribe("events"), HANG_S)
            with pytest.raises(ValueError):
                RedisStore("redis://127.0.0.1:1/0", subscription_ping_s=0)
        finally:
            await store.close()

    asyncio.run(main())
