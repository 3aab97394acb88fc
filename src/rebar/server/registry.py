"""The served models: loaded at start (pinned) or on a request's demand, unloaded when idle or to
make room, all within one memory budget.

Rules, in the order they apply:
- a request names a model by its entry's name; one of the wrong kind or no entry at all is a 400;
- a loaded model serves at once; one that is not loaded starts loading, and its requests wait up
  to `models.load_wait_s`, then get 503 with Retry-After;
- before a load, its estimated footprint (its `memory_budget`, else file size + KV cache) must fit
  in what the loaded models leave of the total budget; idle unpinned models are unloaded, least
  recently used first, until it does; if it still cannot fit, the request gets 503 (Retry-After:
  busy models become idle) and an admin call 409, both with the numbers;
- a model idle for its `keep_alive_s` is unloaded (pinned ones never are);
- an unloaded or replaced version is freed once the last request holding it has finished.
Everything here runs on the server's event loop; loads run in a thread of their own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from rebar.config import ServedModelSettings, Settings
from rebar.server.errors import APIError
from rebar.server.model_instance import Lease, ModelInstance
from rebar.server.model_loading import estimate_bytes, load_instance, total_budget, warm_up

logger = logging.getLogger("rebar.server")

Kind = Literal["chat", "embedding"]
DRAIN_POLL_S = 0.05
Loader = Callable[[Settings, ServedModelSettings, str, int], ModelInstance]


def mib(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:,.0f} MiB"


class InsufficientMemory(APIError):
    """No room for a model in the total budget; `ever` is False when it could never fit."""

    def __init__(self, message: str, ever: bool = True) -> None:
        headers = {"Retry-After": "5"} if ever else None
        super().__init__(503, message, code="insufficient_memory", headers=headers)
        self.ever = ever


@dataclass(eq=False)
class ModelSlot:
    """One entry of the registry and whichever of its versions is loaded."""

    entry: ServedModelSettings
    path: str
    version: int = 1
    current: ModelInstance | None = None
    draining: bool = False  # a reload is freeing the old version before loading the new one
    reloading: bool = False  # a reload is loading the new version beside the old one
    error: str | None = None  # why its last load failed (cleared by the next success)
    loading: asyncio.Task | None = None  # the load (or drain-first reload) in flight
    last_used: float = 0.0
    reserved_bytes: int = 0  # the estimate held for a load in flight
    retired: list[ModelInstance] = field(default_factory=list)  # old versions still finishing
    last_reload: dict | None = None  # the figures of the last reload that switched versions here
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one load/unload/reload at a time

    @property
    def name(self) -> str:
        return self.entry.name

    @property
    def servable(self) -> ModelInstance | None:
        return None if self.draining else self.current

    @property
    def state(self) -> str:
        if self.draining or self.reloading:
            return "reloading"
        if self.current is not None:
            return "loaded"
        if self.loading is not None:
            return "loading"
        return "failed" if self.error else "unloaded"

    def describe(self) -> dict:
        """The slot as `/v1/models` and `/admin/models` show it."""
        current = self.current
        return {
            "id": self.name,
            "kind": self.entry.kind,
            "state": self.state,
            "version": self.version,
            "path": self.path,
            "pinned": self.entry.pinned,
            "memory_bytes": current.footprint_bytes if current is not None else 0,
            "memory_budget": self.entry.memory_budget,
            "in_flight": current.num_leases if current is not None else 0,
            "retiring_versions": [old.version for old in self.retired],
            "error": self.error,
            "last_reload": self.last_reload,
        }


class ModelRegistry:
    def __init__(
        self,
        settings: Settings,
        loader: Loader = load_instance,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.slots = {e.name: ModelSlot(e, e.model) for e in settings.models.entries()}
        self.total_bytes = total_budget(settings)
        self.load_wait_s = settings.models.load_wait_s
        self.drain_timeout_s = settings.limits.request_timeout_s
        self.created = int(time.time())
        self._loader, self._clock = loader, clock
        self._memory = asyncio.Lock()  # room decisions one at a time
        self._tasks: set[asyncio.Task] = set()
        self._reaper: asyncio.Task | None = None

    # ----- lookups -----------------------------------------------------------------------
    def default_name(self, kind: Kind) -> str | None:
        """The first entry of `kind`: what endpoints that take no model name use."""
        return next((s.name for s in self.slots.values() if s.entry.kind == kind), None)

    def slot(self, name: str | None, kind: Kind | None = None) -> ModelSlot:
        """The entry `name` (None: the default of `kind`); 400 (404 with no kind) when there is
        no such entry of that kind."""
        if name is None and kind is not None:
            name = self.default_name(kind)
        slot = self.slots.get(name or "")
        if slot is None or (kind is not None and slot.entry.kind != kind):
            names = [s.name for s in self.slots.values() if kind is None or s.entry.kind == kind]
            what = {"chat": "for generation", "embedding": "for embeddings", None: ""}[kind]
            raise APIError(
                400 if kind is not None else 404,
                f"model {name!r} is not served {what}; available: {', '.join(names) or 'none'}",
                "model",
                "model_not_found",
            )
        return slot

    def loaded(self) -> list[ModelInstance]:
        """Every instance holding memory: the current versions and the retiring ones."""
        return [
            instance
            for slot in self.slots.values()
            for instance in ([slot.current] if slot.current else []) + slot.retired
        ]

    def loaded_names(self) -> list[str]:
        return [slot.name for slot in self.slots.values() if slot.current is not None]

    def used_bytes(self) -> int:
        reserved = sum(slot.reserved_bytes for slot in self.slots.values())
        return reserved + sum(instance.footprint_bytes for instance in self.loaded())

    # ----- serving -----------------------------------------------------------------------
    async def acquire(self, name: str | None, kind: Kind) -> Lease:
        """A lease on the model's current version, loading it first if need be (waiting up to
        `load_wait_s`). Raises 400 for an unknown model, 503 when it cannot be served now."""
        slot = self.slot(name, kind)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.load_wait_s
        while True:
            instance = slot.servable
            if instance is not None:
                slot.last_used = self._clock()
                return instance.lease(on_release=lambda: self.touch(slot))
            if slot.draining:  # a reload frees the old version before loading the new one
                if loop.time() >= deadline:
                    raise self._still_loading(slot)
                await asyncio.sleep(DRAIN_POLL_S)
                continue
            if slot.loading is None:
                if slot.error is not None:
                    raise APIError(
                        503, f"model {slot.name!r} failed to load: {slot.error}", code="not_ready"
                    )
                self._start_load(slot)
            assert slot.loading is not None
            task = slot.loading
            done, _ = await asyncio.wait({task}, timeout=max(0.0, deadline - loop.time()))
            if not done:
                raise self._still_loading(slot)
            error = task.exception()
            if isinstance(error, APIError):
                raise error
            if error is not None:
                raise APIError(
                    503, f"model {slot.name!r} failed to load: {error}", code="not_ready"
                ) from None

    @staticmethod
    def _still_loading(slot: ModelSlot) -> APIError:
        return APIError(
            503,
            f"model {slot.name!r} is still loading; retry later",
            code="model_loading",
            headers={"Retry-After": "5"},
        )

    def touch(self, slot: ModelSlot) -> None:
        """`slot` was just used (keep-alive and LRU eviction count from here)."""
        slot.last_used = self._clock()

    # ----- loading and unloading ---------------------------------------------------------
    def install(self, name: str, instance: ModelInstance) -> None:
        """Serve an instance loaded elsewhere (tests, and models handed to `create_app`)."""
        slot = self.slots[name]
        slot.current, slot.error, slot.last_used = instance, None, self._clock()

    async def start(self) -> None:
        """Load the pinned models (in order; the first failure raises) and start the keep-alive
        reaper."""
        for slot in self.slots.values():
            if slot.entry.pinned and slot.current is None:
                await self.load(slot.name)
        self._reaper = asyncio.create_task(self._reap_idle())

    def _start_load(self, slot: ModelSlot) -> asyncio.Task:
        task = asyncio.create_task(self._load_now(slot))
        slot.loading = task
        task.add_done_callback(lambda t: self._load_ended(slot, t))
        return task

    def _load_ended(self, slot: ModelSlot, task: asyncio.Task) -> None:
        if slot.loading is task:
            slot.loading = None
        if not task.cancelled():
            task.exception()  # retrieved: waiters and admin calls report it

    async def load(self, name: str) -> ModelSlot:
        """Load the model now (an admin call, or start-up); a loaded one is left as it is."""
        slot = self.slot(name)
        if slot.current is None:
            await asyncio.shield(slot.loading or self._start_load(slot))
        return slot

    async def _load_now(self, slot: ModelSlot) -> None:
        async with slot.lock:
            if slot.current is not None:
                return
            try:
                instance = await self.load_version(slot, slot.path, slot.version)
            except InsufficientMemory:
                raise  # not the model's fault: the next request tries again
            except Exception as exc:
                slot.error = str(exc)  # reported to every request until a load succeeds
                raise
            slot.current, slot.error, slot.last_used = instance, None, self._clock()
            logger.info(
                "loaded %s v%d in %.1fs (%s)",
                slot.name,
                slot.version,
                instance.load_seconds,
                mib(instance.footprint_bytes),
            )

    async def load_version(self, slot: ModelSlot, path: str, version: int) -> ModelInstance:
        """Load and warm `path` as `version` of `slot` once room has been made for it; does not
        switch anything (the caller does)."""
        estimate = estimate_bytes(self.settings, slot.entry, path)
        await self.make_room(slot, estimate)
        try:
            instance = await _in_thread(self._loader, self.settings, slot.entry, path, version)
            await warm_up(instance)
        except Exception as exc:
            logger.error("loading %s v%d from %s failed: %s", slot.name, version, path, exc)
            raise
        finally:
            slot.reserved_bytes = 0
        if self.used_bytes() > self.total_bytes:
            logger.warning(
                "%s v%d holds %s (estimated %s): the models now hold %s of a %s budget",
                slot.name,
                version,
                mib(instance.footprint_bytes),
                mib(estimate),
                mib(self.used_bytes()),
                mib(self.total_bytes),
            )
        return instance

    async def make_room(self, slot: ModelSlot, need: int) -> None:
        """Reserve `need` bytes for a load of `slot`, unloading idle unpinned models (least
        recently used first) until it fits; raises InsufficientMemory with the numbers."""
        async with self._memory:
            if need > self.total_bytes:
                raise InsufficientMemory(
                    f"model {slot.name!r} needs about {mib(need)}, more than the whole memory "
                    f"budget of {mib(self.total_bytes)} (models.memory_budget)",
                    ever=False,
                )
            idle = sorted(
                (
                    other
                    for other in self.slots.values()
                    if other is not slot
                    and not other.entry.pinned
                    and other.current is not None
                    and other.current.num_leases == 0
                    and other.loading is None
                    and not other.lock.locked()  # not mid-reload or mid-unload
                ),
                key=lambda other: other.last_used,
            )
            while self.total_bytes - self.used_bytes() < need and idle:
                victim = idle.pop(0)
                evicted, victim.current = victim.current, None
                assert evicted is not None
                logger.info("unloading idle %s to make room for %s", victim.name, slot.name)
                await self.retire_later(victim, evicted)
            free = self.total_bytes - self.used_bytes()
            if free < need:
                held = ", ".join(
                    f"{s.name} {mib(s.current.footprint_bytes)}"
                    for s in self.slots.values()
                    if s.current is not None
                )
                raise InsufficientMemory(
                    f"not enough memory to load {slot.name!r}: it needs about {mib(need)}, "
                    f"{mib(max(free, 0))} of the {mib(self.total_bytes)} budget is free; "
                    f"held by busy or pinned models ({held or 'none'})"
                )
            slot.reserved_bytes = need

    async def unload(self, name: str) -> ModelSlot:
        """Stop serving the model; its requests in flight finish first, then it is freed."""
        slot = self.slot(name)
        async with slot.lock:
            instance, slot.current = slot.current, None
            if instance is not None:
                logger.info("unloading %s v%d", slot.name, instance.version)
                self.retire_later(slot, instance)
        return slot

    def retire_later(self, slot: ModelSlot, instance: ModelInstance) -> asyncio.Task:
        """Free `instance` once its last lease ends (in the background); it counts against the
        budget until then."""
        slot.retired.append(instance)
        task = asyncio.create_task(self._retire(slot, instance))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _retire(self, slot: ModelSlot, instance: ModelInstance) -> None:
        try:
            if not await instance.wait_idle(self.drain_timeout_s):
                logger.warning(
                    "%s v%d still had %d requests after %.0fs; stopping it anyway",
                    slot.name,
                    instance.version,
                    instance.num_leases,
                    self.drain_timeout_s,
                )
            await asyncio.to_thread(instance.close)
        finally:
            slot.retired.remove(instance)
        logger.info("freed %s v%d", slot.name, instance.version)

    async def _reap_idle(self) -> None:
        while True:
            await asyncio.sleep(self._reap_interval())
            now = self._clock()
            for slot in self.slots.values():
                current = slot.current
                if (
                    current is not None
                    and not slot.entry.pinned
                    and current.num_leases == 0
                    and slot.loading is None
                    and not slot.lock.locked()
                    and now - slot.last_used >= slot.entry.keep_alive_s
                ):
                    logger.info("%s idle for %.0fs: unloading", slot.name, now - slot.last_used)
                    await self.unload(slot.name)

    def _reap_interval(self) -> float:
        alive = [s.entry.keep_alive_s for s in self.slots.values() if not s.entry.pinned]
        return min([1.0, *(max(0.05, k / 4) for k in alive)])

    async def close(self) -> None:
        """Stop the reaper and every engine (at shutdown, after the drain)."""
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        for task in list(self._tasks):
            task.cancel()
        for instance in self.loaded():
            await asyncio.to_thread(instance.close)
        for slot in self.slots.values():
            slot.current = None


async def _in_thread(function, *args):
    # A plain daemon thread: a slow load must not keep the interpreter alive at shutdown.
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(setter, value) -> None:
        if not future.done():
            setter(value)

    def run() -> None:
        try:
            result = function(*args)
            loop.call_soon_threadsafe(settle, future.set_result, result)
        except BaseException as exc:
            loop.call_soon_threadsafe(settle, future.set_exception, exc)

    threading.Thread(target=run, name="rebar-model-load", daemon=True).start()
    return await future
