"""The model registry's rules on stand-in models: on-demand loads and their wait bound, the memory
budget with LRU eviction of idle models, keep-alive, pinned models, leases that keep an old
version alive until its last request ends, failed loads."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest

from rebar.config import load_settings
from rebar.errors import ConfigError
from rebar.server.errors import problem_of
from rebar.serving.errors import ServingError
from rebar.serving.instances import ChatModel
from rebar.serving.registry import ModelRegistry

MiB = 2**20


class FakeEngine:
    """Enough of an engine for the registry: start, one warm-up generation, shutdown."""

    failure = None

    def __init__(self) -> None:
        self.stopped = False

    def start(self) -> None:
        pass

    async def generate(self, *args, **kwargs):
        yield SimpleNamespace()

    def shutdown(self) -> None:
        self.stopped = True


class FakeLoader:
    """Loads instantly (or after `delay_s`, or never until `gate` is set), or fails for names in
    `broken`; records every load."""

    def __init__(self) -> None:
        self.loads: list[tuple[str, str, int]] = []
        self.delay_s = 0.0
        self.gate: threading.Event | None = None
        self.broken: set[str] = set()
        self.engines: list[FakeEngine] = []

    def __call__(self, settings, entry, path, version) -> ChatModel:
        if self.gate is not None:
            self.gate.wait(10)
        time.sleep(self.delay_s)
        if entry.name in self.broken:
            raise ConfigError(f"{path}: the contract says otherwise")
        self.loads.append((entry.name, path, version))
        engine = FakeEngine()
        self.engines.append(engine)
        text = SimpleNamespace(load_seconds=0.0)
        return ChatModel(entry, version, path, text, entry.memory_budget, 0.0, engine=engine)


def registry(
    serve: list[dict], total_mib: int = 1000, **models
) -> tuple[ModelRegistry, FakeLoader]:
    settings = load_settings(
        None,
        {
            "models.chat": "",
            "models.embedding": "",
            "models.serve": [
                {"model": e["name"] + ".gguf", "memory_budget": 100 * MiB, **e} for e in serve
            ],
            "models.memory_budget": total_mib * MiB,
            **{f"models.{k}": v for k, v in models.items()},
            "limits.request_timeout_s": 5,
        },
    )
    loader = FakeLoader()
    return ModelRegistry(settings, loader=loader), loader


def run(coroutine):
    return asyncio.run(coroutine)


def test_a_request_loads_an_unloaded_model_and_later_ones_share_it() -> None:
    async def scenario():
        reg, loader = registry([{"name": "a"}])
        assert reg.slots["a"].state == "unloaded"
        leases = await asyncio.gather(*(reg.acquire("a", "chat") for _ in range(5)))
        assert loader.loads == [("a", "a.gguf", 1)]  # one load for five waiting requests
        assert reg.slots["a"].state == "loaded" and reg.slots["a"].current.num_leases == 5
        for lease in leases:
            lease.release()
            lease.release()  # idempotent
        assert reg.slots["a"].current.num_leases == 0
        await reg.close()

    run(scenario())


def test_unknown_models_and_wrong_kinds_are_400_naming_the_choices() -> None:
    async def scenario():
        reg, _ = registry([{"name": "a"}, {"name": "e", "kind": "embedding"}])
        with pytest.raises(ServingError) as caught:
            await reg.acquire("nope", "chat")
        assert problem_of(caught.value).status == 400 and problem_of(caught.value).param == "model"
        assert "available: a" in str(caught.value)
        with pytest.raises(ServingError) as caught:
            await reg.acquire("e", "chat")  # an embedding model cannot generate
        assert (
            problem_of(caught.value).status == 400
            and problem_of(caught.value).code == "model_not_found"
        )
        assert (await reg.acquire(None, "embedding")).version.entry.name == "e"  # the default
        await reg.close()

    run(scenario())


def test_a_slow_load_answers_503_with_retry_after_once_the_wait_bound_passes() -> None:
    async def scenario():
        reg, loader = registry([{"name": "a"}], load_wait_s=0.3)
        loader.gate = threading.Event()
        started = time.monotonic()
        with pytest.raises(ServingError) as caught:
            await reg.acquire("a", "chat")
        # It waited its bound (a lower bound: a slow machine only waits longer), and it did not
        # wait for the load: that is still held at the gate.
        assert time.monotonic() - started > 0.25 and not loader.gate.is_set()
        problem = problem_of(caught.value)
        assert problem.status == 503 and problem.code == "model_loading"
        assert problem.headers["Retry-After"] == "5"
        assert reg.slots["a"].state == "loading"
        loader.gate.set()  # the load carries on; the next request is served
        lease = await reg.acquire("a", "chat")
        assert loader.loads == [("a", "a.gguf", 1)]
        lease.release()
        await reg.close()

    run(scenario())


def test_idle_models_are_evicted_least_recently_used_first() -> None:
    async def scenario():
        reg, loader = registry([{"name": n} for n in "abcd"], total_mib=300)
        for name in "abc":
            (await reg.acquire(name, "chat")).release()
            await asyncio.sleep(0.01)
        (await reg.acquire("a", "chat")).release()  # a is now the most recently used
        first_b = reg.slots["b"].current
        lease = await reg.acquire("d", "chat")  # 300 MiB hold three: the LRU one (b) goes
        assert [n for n, s in reg.slots.items() if s.current is not None] == ["a", "c", "d"]
        assert reg.used_bytes() == 300 * MiB
        assert first_b.closed and loader.engines[1].stopped
        lease.release()
        await reg.close()

    run(scenario())


def test_an_eviction_gives_memory_back_at_once_and_a_shutdown_only_stops_the_engines(
    monkeypatch,
) -> None:
    """An evicted version's weights are collected now (the process serves on); at shutdown every
    engine stops without the full collection (~0.2 s a model) that nothing after it needs."""
    import rebar.serving.instances as instances

    collections: list[int] = []
    monkeypatch.setattr(instances.gc, "collect", lambda: collections.append(1) or 0)

    async def scenario():
        reg, loader = registry([{"name": n} for n in "abc"], total_mib=200)
        for name in "ab":
            (await reg.acquire(name, "chat")).release()
        (await reg.acquire("c", "chat")).release()  # evicts a
        assert loader.engines[0].stopped and len(collections) == 1
        await reg.close()
        assert all(engine.stopped for engine in loader.engines) and len(collections) == 1

    run(scenario())


def test_busy_and_pinned_models_are_never_evicted_and_the_refusal_has_the_numbers() -> None:
    async def scenario():
        reg, _ = registry(
            [{"name": "p", "pinned": True}, {"name": "a"}, {"name": "b"}], total_mib=200
        )
        await reg.start()  # loads the pinned one
        assert reg.slots["p"].state == "loaded"
        busy = await reg.acquire("a", "chat")
        with pytest.raises(ServingError) as caught:
            await reg.acquire("b", "chat")
        error = problem_of(caught.value)
        assert error.status == 503 and error.code == "insufficient_memory"
        assert error.headers["Retry-After"] == "5"
        assert "needs about 100 MiB, 0 MiB of the 200 MiB budget is free" in str(caught.value)
        assert "p 100 MiB" in str(caught.value) and "a 100 MiB" in str(caught.value)
        assert reg.slots["b"].state == "unloaded" and reg.slots["b"].error is None
        busy.release()  # now a is idle: b evicts it
        (await reg.acquire("b", "chat")).release()
        assert reg.slots["a"].current is None and reg.slots["p"].current is not None
        await reg.close()

    run(scenario())


def test_a_model_bigger_than_the_whole_budget_is_refused_for_good() -> None:
    async def scenario():
        reg, loader = registry([{"name": "big", "memory_budget": 500 * MiB}], total_mib=400)
        with pytest.raises(ServingError) as caught:
            await reg.acquire("big", "chat")
        assert (
            problem_of(caught.value).code == "insufficient_memory"
            and not problem_of(caught.value).headers
        )
        assert "more than the whole memory budget of 400 MiB" in str(caught.value)
        assert loader.loads == []
        await reg.close()

    run(scenario())


def test_keep_alive_unloads_idle_models_but_never_pinned_or_busy_ones() -> None:
    async def scenario():
        reg, loader = registry(
            [
                {"name": "p", "pinned": True, "keep_alive_s": 0},
                {"name": "quick", "keep_alive_s": 0.2},
                {"name": "held", "keep_alive_s": 0.2},
            ]
        )
        await reg.start()
        (await reg.acquire("quick", "chat")).release()
        held = await reg.acquire("held", "chat")
        await asyncio.sleep(0.8)
        assert reg.slots["quick"].state == "unloaded"
        assert reg.slots["p"].state == "loaded" and reg.slots["held"].state == "loaded"
        held.release()
        await asyncio.sleep(0.8)
        assert reg.slots["held"].state == "unloaded"
        (await reg.acquire("quick", "chat")).release()  # unloaded is not failed: loads again
        assert [name for name, _, _ in loader.loads] == ["p", "quick", "held", "quick"]
        await reg.close()

    run(scenario())


def test_an_unloaded_version_is_freed_only_when_its_last_request_ends() -> None:
    async def scenario():
        reg, _ = registry([{"name": "a"}])
        lease = await reg.acquire("a", "chat")
        instance = lease.version
        await reg.unload("a")
        assert reg.slots["a"].state == "unloaded"
        await asyncio.sleep(0.1)
        assert not instance.closed and reg.slots["a"].describe()["retiring_versions"] == [1]
        assert reg.used_bytes() == 100 * MiB  # still held
        lease.release()
        for _ in range(100):
            if instance.closed and not reg.slots["a"].retired:
                break
            await asyncio.sleep(0.02)
        assert instance.closed and reg.used_bytes() == 0
        await reg.close()

    run(scenario())


def test_a_failed_load_is_reported_until_a_load_succeeds() -> None:
    async def scenario():
        reg, loader = registry([{"name": "a"}])
        loader.broken.add("a")
        for _ in range(2):
            with pytest.raises(ServingError) as caught:
                await reg.acquire("a", "chat")
            assert problem_of(caught.value).status == 503 and "the contract says otherwise" in str(
                str(caught.value)
            )
        assert reg.slots["a"].state == "failed" and loader.loads == []  # not retried per request
        loader.broken.clear()
        await reg.load("a")  # an admin load retries
        assert reg.slots["a"].state == "loaded" and reg.slots["a"].error is None
        assert reg.used_bytes() == 100 * MiB
        await reg.close()

    run(scenario())
