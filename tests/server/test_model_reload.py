"""Hot reload on stand-in models: beside the old version when memory allows, else after draining
it; a refused load keeps the old version serving; versions are claimed in the store, announced
over its pub/sub and followed by every registry subscribed (two registries on one store stand for
two processes)."""

from __future__ import annotations

import ast
import asyncio
import inspect
import textwrap
import threading

import pytest
from test_registry import MiB, registry

from rebar.server.errors import problem_of
from rebar.serving import reload as model_reload
from rebar.serving.errors import ServingError
from rebar.serving.reload import ModelReloads, reload_slot
from rebar.store import MemoryStore
from waiting import wait_until_async as wait_for


def run(coroutine):
    return asyncio.run(coroutine)


def test_the_swap_is_one_assignment_with_nothing_awaited() -> None:
    """What `swap_ms` times is, by construction, a single tuple assignment of the slot's current
    instance, version, path and error: nothing awaited, so no request on the event loop can see a
    half-switched slot, and its duration is no function of load or model size. (Checking its
    figure against a wall-clock bound would only measure the machine.)"""
    tree = ast.parse(textwrap.dedent(inspect.getsource(model_reload.reload_slot)))
    body = next(n for n in ast.walk(tree) if isinstance(n, ast.AsyncFunctionDef)).body
    flat = [n for statement in body for n in ast.walk(statement) if isinstance(n, ast.stmt)]
    names = [ast.unparse(n) for n in flat]
    start = next(i for i, text in enumerate(names) if text.startswith("switched = "))
    end = next(i for i, text in enumerate(names) if text.startswith("swap_ms = "))
    timed = flat[start + 1 : end]
    assert len(timed) == 1 and isinstance(timed[0], ast.Assign), names[start:end]
    (target,) = timed[0].targets
    assert isinstance(target, ast.Tuple)
    assert [ast.unparse(t) for t in target.elts][:2] == ["slot.current", "slot.version"]
    assert not any(isinstance(n, ast.Await) for n in ast.walk(timed[0]))


def test_a_reload_loads_beside_the_old_version_and_switches_new_requests_only() -> None:
    async def scenario():
        reg, loader = registry([{"name": "a"}])
        old_lease = await reg.acquire("a", "chat")
        outcome = await reload_slot(reg, reg.slots["a"], "a2.gguf", 2)
        assert outcome is not None and not outcome.drained_first
        assert outcome.version == 2 and outcome.previous_version == 1 and outcome.swap_ms >= 0
        new_lease = await reg.acquire("a", "chat")
        assert new_lease.version.version == 2 and new_lease.version.path == "a2.gguf"
        assert old_lease.version.version == 1 and not old_lease.version.closed  # still busy
        assert reg.used_bytes() == 200 * MiB
        old_lease.release()
        assert await wait_for(lambda: old_lease.version.closed and not reg.slots["a"].retired)
        assert reg.used_bytes() == 100 * MiB and reg.slots["a"].describe()["version"] == 2
        new_lease.release()
        assert await reload_slot(reg, reg.slots["a"], "a2.gguf", 2) is None  # not newer: ignored
        assert len(loader.loads) == 2
        await reg.close()

    run(scenario())


def test_without_memory_for_both_the_old_version_drains_first_and_requests_wait() -> None:
    async def scenario():
        reg, _ = registry([{"name": "a"}], total_mib=150)
        lease = await reg.acquire("a", "chat")
        reloading = asyncio.create_task(reload_slot(reg, reg.slots["a"], "a2.gguf", 2))
        await asyncio.sleep(0.1)
        assert reg.slots["a"].state == "reloading" and not reloading.done()
        waiting = asyncio.create_task(reg.acquire("a", "chat"))  # waits for the new version
        await asyncio.sleep(0.1)
        assert not waiting.done()
        lease.release()  # the old version drains: now the new one loads
        outcome = await reloading
        assert outcome.drained_first and lease.version.closed
        assert (await waiting).version.version == 2
        assert reg.used_bytes() == 100 * MiB
        await reg.close()

    run(scenario())


def test_a_reload_that_fails_keeps_the_old_version_serving() -> None:
    async def scenario():
        reg, loader = registry([{"name": "a"}])
        (await reg.acquire("a", "chat")).release()
        loader.broken.add("a")
        with pytest.raises(ServingError) as caught:
            await reload_slot(reg, reg.slots["a"], "bad.gguf", 2)
        assert (
            problem_of(caught.value).status == 409
            and problem_of(caught.value).code == "reload_refused"
        )
        assert "v1 keeps serving" in str(caught.value)
        assert "the contract says otherwise" in str(caught.value)
        slot = reg.slots["a"]
        assert slot.state == "loaded" and slot.version == 1 and slot.path == "a.gguf"
        assert slot.error is None and slot.describe()["last_reload"]["refused"].startswith(
            "reload of 'a' to bad.gguf refused"
        )
        lease = await reg.acquire("a", "chat")
        assert lease.version.version == 1
        assert reg.used_bytes() == 100 * MiB  # nothing of the refused version left
        # The refused path does not poison the model: unloaded, it loads its own version again.
        lease.release()
        await reg.unload("a")
        loader.broken.clear()
        assert (await reg.acquire("a", "chat")).version.path == "a.gguf"
        await reg.close()

    run(scenario())


def test_a_refused_drain_first_reload_brings_the_old_version_back_on_the_next_request() -> None:
    async def scenario():
        reg, loader = registry([{"name": "a"}], total_mib=150)
        (await reg.acquire("a", "chat")).release()
        loader.broken.add("a")
        with pytest.raises(ServingError) as caught:
            await reload_slot(reg, reg.slots["a"], "bad.gguf", 2)
        assert "the next request loads v1 again" in str(caught.value)
        assert reg.slots["a"].state == "unloaded" and reg.used_bytes() == 0
        loader.broken.clear()
        lease = await reg.acquire("a", "chat")
        assert (lease.version.version, lease.version.path) == (1, "a.gguf")
        await reg.close()

    run(scenario())


def test_a_model_in_the_middle_of_a_reload_is_never_evicted_for_another() -> None:
    async def scenario():
        reg, loader = registry([{"name": "a"}, {"name": "b"}], total_mib=250)
        (await reg.acquire("a", "chat")).release()
        loader.gate = threading.Event()  # a's new version loads until the gate opens
        reloading = asyncio.create_task(reload_slot(reg, reg.slots["a"], "a2.gguf", 2))
        await asyncio.sleep(0.1)
        with pytest.raises(ServingError) as caught:  # 250 MiB: a v1 and a v2 (reserved) leave 50
            await asyncio.wait_for(reg.acquire("b", "chat"), 5)
        assert problem_of(caught.value).code == "insufficient_memory"
        assert reg.slots["a"].current is not None and reg.slots["a"].current.version == 1
        loader.gate.set()
        assert (await reloading).version == 2
        await reg.close()

    run(scenario())


def test_a_reload_is_claimed_recorded_and_followed_by_every_subscribed_registry() -> None:
    async def scenario():
        store = MemoryStore()
        processes = [registry([{"name": "a"}, {"name": "idle"}]) for _ in range(2)]
        reloads = [ModelReloads(reg, store, "rebar") for reg, _ in processes]
        for (reg, _), r in zip(processes, reloads):
            (await reg.acquire("a", "chat")).release()
            r.start()
            assert await r.wait_subscribed(5)
        outcome = await reloads[0].reload("a", "a2.gguf")
        assert outcome.version == 2 and outcome.processes_reached == 1
        other = processes[1][0]
        assert await wait_for(lambda: other.slots["a"].version == 2)
        assert other.slots["a"].current.path == "a2.gguf"
        # The second announcement comes from the other process: versions never collide.
        assert (await reloads[1].reload("a")).version == 3
        assert await wait_for(lambda: processes[0][0].slots["a"].version == 3)
        # A model not loaded somewhere takes the new version at its next load.
        await reloads[0].reload("idle", "idle2.gguf")
        assert await wait_for(lambda: other.slots["idle"].version == 2)
        assert other.slots["idle"].current is None and other.slots["idle"].path == "idle2.gguf"
        # A process started after the reloads adopts the current versions before loading.
        late, late_loader = registry([{"name": "a"}, {"name": "idle"}])
        await ModelReloads(late, store, "rebar").adopt_current()
        (await late.acquire("a", "chat")).release()
        assert late_loader.loads == [("a", "a2.gguf", 3)]
        for (reg, _), r in zip(processes, reloads):
            await r.close()
            await reg.close()
        await late.close()

    run(scenario())


def test_unreadable_messages_and_unknown_models_are_ignored() -> None:
    async def scenario():
        store = MemoryStore()
        reg, loader = registry([{"name": "a"}])
        reloads = ModelReloads(reg, store, "rebar")
        reloads.start()
        assert await reloads.wait_subscribed(5)
        for message in (
            b"not json",
            b'{"name": "a"}',
            b'{"name": "zz", "version": 9, "path": "x"}',
        ):
            await store.publish("rebar:models:reload", message)
        await store.set("rebar:models:a:current", b"garbage")
        await asyncio.sleep(0.2)
        assert reg.slots["a"].version == 1 and loader.loads == []
        assert reloads._watcher is not None and not reloads._watcher.done()  # still listening
        await reloads.close()
        await reg.close()

    run(scenario())
