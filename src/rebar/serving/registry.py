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
from typing import Literal, cast

from rebar.config import ServedModelSettings, Settings
from rebar.serving.errors import (
    EngineStopped,
    InsufficientMemory,
    ModelFailed,
    ModelLoading,
    NoSuchEntry,
    NotReady,
    ServingError,
    UnknownModel,
)
from rebar.serving.instances import ChatModel, EmbeddingModel, Lease, ModelVersion
from rebar.serving.loading import estimate_bytes, load_instance, total_budget, warm_up
from rebar.serving.slots import ModelSlot, mib

logger = logging.getLogger("rebar.serving")

Kind = Literal["chat", "embedding"]
DRAIN_POLL_S = 0.05
LOAD_RETRY_AFTER_S = 5
NOT_READY_RETRY_S = 5
Loader = Callable[[Settings, ServedModelSettings, str, int], ModelVersion]


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
        self.ready = False  # the pinned models are loaded and warm
        self.load_error: str | None = None  # why loading the pinned models failed
        self._memory = asyncio.Lock()  # room decisions one at a time
        self._tasks: set[asyncio.Task] = set()
        self._reaper: asyncio.Task | None = None

    # ----- lookups -----------------------------------------------------------------------
    def check_ready(self) -> None:
        """Raises EngineStopped when a chat engine stopped serving, NotReady while the pinned
        models load (or after their load failed)."""
        failure = self.engine_failure()
        if failure is not None:
            raise EngineStopped(failure)
        if not self.ready:
            if self.load_error:
                raise NotReady(f"model failed to load: {self.load_error}", NOT_READY_RETRY_S)
            raise NotReady("the model is still loading", NOT_READY_RETRY_S)

    def engine_failure(self) -> str | None:
        """Why a chat engine stopped serving (its process exited), or None while they serve."""
        for version in self.loaded():
            engine = version.engine if isinstance(version, ChatModel) else None
            if engine is not None and engine.failure is not None:
                return engine.failure
        return None

    def default_name(self, kind: Kind) -> str | None:
        """The first entry of `kind`: what endpoints that take no model name use."""
        return next((s.name for s in self.slots.values() if s.entry.kind == kind), None)

    def slot(self, name: str | None, kind: Kind | None = None) -> ModelSlot:
        """The entry `name` (None: the default of `kind`); raises UnknownModel (NoSuchEntry when
        no kind is asked for) when there is no such entry of that kind."""
        if name is None and kind is not None:
            name = self.default_name(kind)
        slot = self.slots.get(name or "")
        if slot is None or (kind is not None and slot.entry.kind != kind):
            names = [s.name for s in self.slots.values() if kind is None or s.entry.kind == kind]
            what = {"chat": "for generation", "embedding": "for embeddings", None: ""}[kind]
            error = UnknownModel if kind is not None else NoSuchEntry
            raise error(
                f"model {name!r} is not served {what}; available: {', '.join(names) or 'none'}"
            )
        return slot

    def loaded(self) -> list[ModelVersion]:
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
    async def acquire_chat(self, name: str | None) -> Lease[ChatModel]:
        """A lease on the chat model `name` (None: the default one); see `acquire`."""
        lease = await self.acquire(name, "chat")
        assert isinstance(lease.version, ChatModel), lease.version
        return cast(Lease[ChatModel], lease)

    async def acquire_embedding(self, name: str | None) -> Lease[EmbeddingModel]:
        """A lease on the embedding model `name` (None: the default one); see `acquire`."""
        lease = await self.acquire(name, "embedding")
        assert isinstance(lease.version, EmbeddingModel), lease.version
        return cast(Lease[EmbeddingModel], lease)

    async def acquire(self, name: str | None, kind: Kind) -> Lease:
        """A lease on the model's current version, loading it first if need be (waiting up to
        `load_wait_s`). Raises UnknownModel, or a ServingError when it cannot be served now."""
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
                    raise ModelFailed(f"model {slot.name!r} failed to load: {slot.error}")
                self._start_load(slot)
            assert slot.loading is not None
            task = slot.loading
            done, _ = await asyncio.wait({task}, timeout=max(0.0, deadline - loop.time()))
            if not done:
                raise self._still_loading(slot)
            error = task.exception()
            if isinstance(error, ServingError):
                raise error
            if error is not None:
                raise ModelFailed(f"model {slot.name!r} failed to load: {error}") from None

    @staticmethod
    def _still_loading(slot: ModelSlot) -> ModelLoading:
        return ModelLoading(
            f"model {slot.name!r} is still loading; retry later", LOAD_RETRY_AFTER_S
        )

    def touch(self, slot: ModelSlot) -> None:
        """`slot` was just used (keep-alive and LRU eviction count from here)."""
        slot.last_used = self._clock()

    # ----- loading and unloading ---------------------------------------------------------
    def install(self, name: str, instance: ModelVersion) -> None:
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

    async def load_version(self, slot: ModelSlot, path: str, version: int) -> ModelVersion:
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

    def retire_later(self, slot: ModelSlot, instance: ModelVersion) -> asyncio.Task:
        """Free `instance` once its last lease ends (in the background); it counts against the
        budget until then."""
        slot.retired.append(instance)
        task = asyncio.create_task(self._retire(slot, instance))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _retire(self, slot: ModelSlot, instance: ModelVersion) -> None:
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
            await asyncio.to_thread(instance.close, free_memory=False)
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
