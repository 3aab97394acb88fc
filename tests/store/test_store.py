"""One suite for every Store backend: the same behaviour over `memory` and a real Redis."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import pytest

from rebar.store import MemoryStore, RateDecision, Store, StoreError, open_store
from redis_server import free_port
from waiting import HANG_S

if TYPE_CHECKING:
    from conftest import Backend  # the fixture's type; annotations only


def raw_pttl(backend: Backend, key: str) -> int | None:
    """The key's PTTL read straight from the server (redis-cli), bypassing the store; None for
    memory."""
    return None if backend.server is None else int(backend.server.cli("PTTL", key))


def test_get_set_delete(backend: Backend) -> None:
    async def body(store: Store) -> None:
        assert await store.get("k") is None
        await store.set("k", b"\x00\xffvalue")
        assert await store.get("k") == b"\x00\xffvalue"
        await store.set("k", b"other")
        assert await store.get("k") == b"other"
        await store.delete("k")
        assert await store.get("k") is None
        await store.delete("k")  # absent: not an error
        assert await store.ping() is True

    backend.run(body)


def test_ttl_and_expiry(backend: Backend) -> None:
    async def body(store: Store) -> None:
        assert await store.ttl_ms("missing") is None
        await store.set("forever", b"1")
        assert await store.ttl_ms("forever") == -1
        await store.set("brief", b"1", ttl_ms=200)
        ttl = await store.ttl_ms("brief")
        assert ttl is not None and 0 < ttl <= 200
        if backend.server is not None:
            assert 0 < raw_pttl(backend, "brief") <= 200
            assert raw_pttl(backend, "forever") == -1
        # Overwriting without a TTL removes the expiry, as SET does.
        await store.set("forever", b"2", ttl_ms=5000)
        await store.set("forever", b"3")
        assert await store.ttl_ms("forever") == -1
        await asyncio.sleep(0.3)
        assert await store.get("brief") is None
        assert await store.ttl_ms("brief") is None
        if backend.server is not None:
            assert raw_pttl(backend, "brief") == -2

    backend.run(body)


def test_set_if_absent_is_a_lock(backend: Backend) -> None:
    async def body(store: Store) -> None:
        assert await store.set_if_absent("lock", b"a", ttl_ms=200) is True
        assert await store.set_if_absent("lock", b"b", ttl_ms=200) is False
        assert await store.get("lock") == b"a"
        ttl = await store.ttl_ms("lock")
        assert ttl is not None and 0 < ttl <= 200
        if backend.server is not None:
            assert 0 < raw_pttl(backend, "lock") <= 200
        await asyncio.sleep(0.3)  # the holder "crashed": the lock expires
        assert await store.set_if_absent("lock", b"c", ttl_ms=1000) is True
        await store.delete("lock")
        assert await store.set_if_absent("lock", b"d") is True
        assert await store.ttl_ms("lock") == -1
        # Many contenders at once: exactly one wins.
        await store.delete("lock")
        wins = await asyncio.gather(
            *(store.set_if_absent("lock", str(i).encode(), 1000) for i in range(30))
        )
        assert sum(wins) == 1

    backend.run(body)


def test_invalid_arguments_raise_before_io(backend: Backend) -> None:
    async def body(store: Store) -> None:
        with pytest.raises(ValueError):
            await store.set("k", b"v", ttl_ms=0)
        with pytest.raises(ValueError):
            await store.set_if_absent("k", b"v", ttl_ms=-5)
        with pytest.raises(TypeError):
            await store.set("k", "not bytes")  # type: ignore[arg-type]
        with pytest.raises(ValueError):
            await store.rate_limit("rl", -1, 10, 1000)
        with pytest.raises(ValueError):
            await store.rate_limit("rl", 1, 10, 0)
        assert await store.get("k") is None

    backend.run(body)


def test_rate_limit_fixed_window(backend: Backend) -> None:
    async def body(store: Store) -> None:
        first = await store.rate_limit("rl", 1, 3, 400)
        assert first.allowed and first.remaining == 2 and 0 < first.reset_ms <= 400
        assert (await store.rate_limit("rl", 1, 3, 400)).remaining == 1
        third = await store.rate_limit("rl", 1, 3, 400)
        assert third.allowed and third.remaining == 0
        assert third.reset_ms <= first.reset_ms  # later calls do not extend the window
        denied = await store.rate_limit("rl", 1, 3, 400)
        assert denied == RateDecision(allowed=False, remaining=0, reset_ms=denied.reset_ms)
        assert 0 < denied.reset_ms <= 400
        assert await store.get("rl") == b"3"  # the denied call consumed nothing
        if backend.server is not None:
            assert 0 < raw_pttl(backend, "rl") <= 400
        await asyncio.sleep(denied.reset_ms / 1000 + 0.05)
        again = await store.rate_limit("rl", 2, 3, 400)
        assert again.allowed and again.remaining == 1 and again.reset_ms > 300  # a new window

    backend.run(body)


def test_rate_limit_cost_above_limit_never_consumes(backend: Backend) -> None:
    async def body(store: Store) -> None:
        fresh = await store.rate_limit("rl", 5, 3, 1000)
        assert fresh == RateDecision(allowed=False, remaining=3, reset_ms=0)  # no window started
        assert await store.get("rl") is None
        assert (await store.rate_limit("rl", 1, 3, 1000)).allowed
        too_big = await store.rate_limit("rl", 3, 3, 1000)
        assert not too_big.allowed and too_big.remaining == 2 and too_big.reset_ms > 0
        assert await store.get("rl") == b"1"
        exact = await store.rate_limit("rl", 2, 3, 1000)
        assert exact.allowed and exact.remaining == 0

    backend.run(body)


def test_rate_limit_clamp_charges_usage_up_to_the_limit(backend: Backend) -> None:
    async def body(store: Store) -> None:
        assert (await store.rate_limit("rl", 8, 10, 1000)).remaining == 2
        over = await store.rate_limit("rl", 5, 10, 1000, clamp=True)
        assert not over.allowed and over.remaining == 0
        assert await store.get("rl") == b"10"
        assert not (await store.rate_limit("rl", 1, 10, 1000)).allowed
        fresh = await store.rate_limit("fresh", 50, 10, 1000, clamp=True)
        assert not fresh.allowed and fresh.remaining == 0 and 0 < fresh.reset_ms <= 1000
        assert await store.get("fresh") == b"10"
        fits = await store.rate_limit("fits", 4, 10, 1000, clamp=True)
        assert fits.allowed and fits.remaining == 6

    backend.run(body)


def test_rate_limit_is_atomic_under_concurrency(backend: Backend) -> None:
    async def body(store: Store) -> None:
        decisions = await asyncio.gather(*(store.rate_limit("rl", 1, 20, 5000) for _ in range(50)))
        allowed = [d for d in decisions if d.allowed]
        assert len(allowed) == 20
        assert sorted(d.remaining for d in allowed) == list(range(20))
        assert await store.get("rl") == b"20"

    backend.run(body)


def test_rate_limit_rejects_non_integer_counter(backend: Backend) -> None:
    async def body(store: Store) -> None:
        await store.set("rl", b"not a number")
        with pytest.raises(StoreError):
            await store.rate_limit("rl", 1, 10, 1000)

    backend.run(body)


def test_two_redis_clients_share_one_limit(redis_server) -> None:
    """Two clients with separate connection pools stand in for two server processes."""
    from rebar.store import RedisStore

    redis_server.cli("FLUSHALL")

    async def main() -> list[RateDecision]:
        stores = [RedisStore(redis_server.url, socket_timeout_s=2.0) for _ in range(2)]
        try:
            calls = [stores[i % 2].rate_limit("shared", 1, 25, 5000) for i in range(60)]
            return await asyncio.gather(*calls)
        finally:
            for store in stores:
                await store.close()

    decisions = asyncio.run(main())
    assert sum(d.allowed for d in decisions) == 25
    assert redis_server.cli("GET", "shared") == "25"


def test_redis_unreachable_raises_store_error_quickly() -> None:
    from rebar.store import RedisStore

    async def main() -> None:
        # Socket timeouts beyond the hang bound: an error that came from a timeout (not from the
        # refused connection) would fail the wait below instead, so no clock is needed.
        store = RedisStore(f"redis://127.0.0.1:{free_port()}/0", socket_timeout_s=2 * HANG_S)
        try:
            assert await asyncio.wait_for(store.ping(), HANG_S) is False
            for call in (store.get("k"), store.set("k", b"v"), store.rate_limit("k", 1, 1, 1000)):
                with pytest.raises(StoreError):
                    await asyncio.wait_for(call, HANG_S)
        finally:
            await store.close()

    asyncio.run(main())


def test_memory_store_evicts_oldest_write_first() -> None:
    async def main() -> None:
        store = MemoryStore(max_entries=3)
        for key in ("a", "b", "c"):
            await store.set(key, b"1")
        await store.set("a", b"2")  # rewriting makes "a" the newest
        await store.set("d", b"1")
        assert await store.get("b") is None
        assert [await store.get(k) for k in ("a", "c", "d")] == [b"2", b"1", b"1"]
        assert len(store) == 3 and store.num_evicted == 1

    asyncio.run(main())


def test_memory_store_holds_at_most_its_byte_budget() -> None:
    async def main() -> None:
        store = MemoryStore(max_entries=1000, max_bytes=10_000)
        for i in range(100):  # 100 values of ~1 KB: ten times the budget
            await store.set(f"k{i}", bytes(1000))
            assert store.num_bytes <= 10_000
        assert (
            await store.get("k99") is not None and await store.get("k0") is None
        )  # oldest went first
        assert store.num_bytes == sum(
            len(k) + 1000 for k in (f"k{i}" for i in range(100)) if k in store._entries
        )
        await store.set("k99", b"small")  # overwriting gives the old value's bytes back
        await store.delete("k98")
        assert store.num_bytes == sum(len(k) + len(v) for k, (v, _) in store._entries.items())
        with pytest.raises(StoreError, match="exceeds the store's budget"):
            await store.set("huge", bytes(20_000))
        await store.close()
        assert store.num_bytes == 0

    asyncio.run(main())


def test_memory_store_uses_its_monotonic_clock() -> None:
    now = [100.0]

    async def main() -> None:
        store = MemoryStore(clock=lambda: now[0])
        await store.set("k", b"v", ttl_ms=1000)
        await store.rate_limit("rl", 1, 1, 1000)
        now[0] += 0.4
        assert await store.ttl_ms("k") == 600
        assert not (await store.rate_limit("rl", 1, 1, 1000)).allowed
        now[0] += 0.6
        assert await store.get("k") is None and len(store) == 1  # dropped lazily on access
        assert (await store.rate_limit("rl", 1, 1, 1000)).allowed

    asyncio.run(main())


def test_open_store_picks_the_backend() -> None:
    from rebar.store import RedisStore

    assert isinstance(open_store(), MemoryStore)
    assert open_store("memory", max_entries=5).max_entries == 5
    assert isinstance(open_store("redis://127.0.0.1:1/0"), RedisStore)
    assert isinstance(open_store("memory://"), Store)
    with pytest.raises(ValueError, match="unknown store backend"):
        open_store("memcached://x")
