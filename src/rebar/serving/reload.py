"""Hot reload: a new version of a served model, announced to every server process over the
store's pub/sub and swapped in by each without losing a request.

In one process, `reload_slot` loads the new version beside the old one when the memory budget
allows (else it drains the old one first, and says so), checks its contract and warms it up (a
load that fails leaves the old version serving), switches new requests to it in one assignment on
the event loop, and frees the old version once its last request has finished.

Across processes, `ModelReloads` keeps each model's current version in the store
(`<prefix>:models:<name>:current`, JSON `{"name", "version", "path"}`), claims version numbers
there so two reloads never share one, and publishes the same record on `<prefix>:models:reload`;
every process subscribed loads it. A process that starts, or reconnects to the store, reads the
current versions first, so it never serves one older than the others do.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from dataclasses import asdict, dataclass

from rebar.serving.errors import InsufficientMemory, ReloadRefused, ReloadSuperseded
from rebar.serving.instances import ModelVersion, wait_set
from rebar.serving.registry import ModelRegistry
from rebar.serving.slots import ModelSlot, mib
from rebar.store import Store, StoreError

logger = logging.getLogger("rebar.serving")

CLAIM_TTL_MS = 7 * 24 * 3600 * 1000  # a claimed version number is kept this long
RESUBSCRIBE_S = 1.0  # wait before subscribing again after the store failed


@dataclass(frozen=True)
class ReloadOutcome:
    name: str
    version: int
    previous_version: int
    path: str
    load_s: float  # loading and warming the new version
    swap_ms: float  # switching new requests to it
    drained_first: bool  # no memory for both: the old version was drained and freed first
    processes_reached: int = 0  # other subscribers the announcement reached (the store says)

    def to_json(self) -> dict:
        return asdict(self)


async def reload_slot(
    registry: ModelRegistry, slot: ModelSlot, path: str, version: int
) -> ReloadOutcome | None:
    """Serve `path` as `version` of `slot`; None when the slot already serves this version or a
    newer one. Raises ReloadRefused when the new version cannot be loaded: the old one keeps
    serving (or, when it had to be drained first, is what the next load brings back)."""
    async with slot.lock:
        if version <= slot.version and slot.current is not None:
            return None
        previous, old = slot.version, slot.current
        started = time.perf_counter()
        new, drained = await _load_new_version(registry, slot, path, version)
        load_s = time.perf_counter() - started
        switched = time.perf_counter()
        slot.current, slot.version, slot.path, slot.error = new, version, path, None
        swap_ms = (time.perf_counter() - switched) * 1000
        registry.touch(slot)
        if old is not None and not drained:
            registry.retire_later(slot, old)
    logger.info(
        "reloaded %s: v%d -> v%d (%s, %s) in %.1fs, swap %.3f ms%s",
        slot.name,
        previous,
        version,
        path,
        mib(new.footprint_bytes),
        load_s,
        swap_ms,
        "; drained the old version first" if drained else "",
    )
    outcome = ReloadOutcome(slot.name, version, previous, path, load_s, swap_ms, drained)
    slot.last_reload = outcome.to_json() | {"at": time.time()}
    return outcome


async def _load_new_version(
    registry: ModelRegistry, slot: ModelSlot, path: str, version: int
) -> tuple[ModelVersion, bool]:
    """(the new version loaded and warmed, whether the old one had to be drained first: no memory
    for both). Called under the slot's lock; switches nothing but a drained old version."""
    previous, old = slot.version, slot.current
    drained = False
    try:
        slot.reloading = True
        try:
            return await registry.load_version(slot, path, version), drained
        except InsufficientMemory as exc:
            if old is None or not exc.ever:
                raise
        drained = True
        logger.warning(
            "reloading %s: no memory for v%d beside v%d; draining v%d first",
            slot.name,
            version,
            previous,
            previous,
        )
        slot.draining = True  # new requests wait for the new version
        slot.current = None
        await registry.retire_later(slot, old)
        return await registry.load_version(slot, path, version), drained
    except Exception as exc:
        keeps = (
            f"v{previous} keeps serving"
            if not drained and old is not None
            else f"the next request loads v{previous} again"
        )
        message = f"reload of {slot.name!r} to {path} refused ({keeps}): {exc}"
        slot.last_reload = {"refused": message, "version": version, "at": time.time()}
        raise ReloadRefused(message) from None
    finally:
        slot.reloading = slot.draining = False


class ModelReloads:
    """Reloads announced through `store` (one per server process)."""

    def __init__(self, registry: ModelRegistry, store: Store, key_prefix: str) -> None:
        self.registry, self.store, self.prefix = registry, store, key_prefix
        self.channel = f"{key_prefix}:models:reload"
        self._watcher: asyncio.Task | None = None
        self._subscribed = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()

    def _current_key(self, name: str) -> str:
        return f"{self.prefix}:models:{name}:current"

    async def adopt_current(self) -> None:
        """Take each unloaded model's current version and path from the store, so its first load
        is that version (loaded ones catch up once subscribed)."""
        for slot in self.registry.slots.values():
            if slot.current is not None:
                continue
            record = await self._record(slot.name)
            if record is not None and record["version"] > slot.version:
                slot.version, slot.path = record["version"], record["path"]

    async def _record(self, name: str) -> dict | None:
        raw = await self.store.get(self._current_key(name))
        return None if raw is None else _version_of(raw, f"the version record of {name}")

    async def reload(self, name: str, path: str | None = None) -> ReloadOutcome:
        """Load a new version here, then record it and announce it to every process."""
        slot = self.registry.slot(name)
        path = path or slot.path
        version = await self._claim_version(slot)
        outcome = await reload_slot(self.registry, slot, path, version)
        if outcome is None:  # another process's newer version arrived while this one waited
            raise ReloadSuperseded(
                f"reload of {name!r} superseded: v{slot.version} was announced meanwhile"
            )
        # The record and the announcement are the same JSON: {"name", "version", "path"}.
        record = json.dumps({"name": name, "version": version, "path": path}).encode()
        await self.store.set(self._current_key(name), record)
        reached = await self.store.publish(self.channel, record)
        # This process's own subscription counts among those reached.
        others = max(0, reached - (1 if self._subscribed.is_set() else 0))
        return ReloadOutcome(**{**outcome.to_json(), "processes_reached": others})

    async def _claim_version(self, slot: ModelSlot) -> int:
        record = await self._record(slot.name)
        version = max(slot.version, record["version"] if record else 0) + 1
        while not await self.store.set_if_absent(
            f"{self.prefix}:models:{slot.name}:version:{version}", b"1", CLAIM_TTL_MS
        ):
            version += 1  # another process claimed it first
        return version

    # ----- the subscriber ----------------------------------------------------------------
    def start(self) -> None:
        self._watcher = asyncio.create_task(self._watch())

    async def wait_subscribed(self, timeout_s: float) -> bool:
        return await wait_set(self._subscribed, timeout_s)

    async def _watch(self) -> None:
        while True:
            try:
                subscription = await self.store.subscribe(self.channel)
            except StoreError as exc:
                logger.warning("cannot subscribe to model reloads (%s); retrying", exc)
                await asyncio.sleep(RESUBSCRIBE_S)
                continue
            try:
                self._subscribed.set()
                await self._catch_up()  # what was announced while this process was not listening
                async for message in subscription:
                    self._on_message(message)
            except StoreError as exc:
                logger.warning("model reload subscription lost (%s); subscribing again", exc)
            finally:
                self._subscribed.clear()
                with contextlib.suppress(Exception):
                    await subscription.close()
            await asyncio.sleep(RESUBSCRIBE_S)

    async def _catch_up(self) -> None:
        for slot in self.registry.slots.values():
            record = await self._record(slot.name)
            if record is not None and record["version"] > slot.version:
                self._follow(slot, record["path"], record["version"])

    def _on_message(self, raw: bytes) -> None:
        message = _version_of(raw, "a model reload message")
        if message is None:
            return
        slot = self.registry.slots.get(message["name"])
        if slot is None:
            logger.warning(
                "ignoring a reload of %r: this server does not serve it", message["name"]
            )
        elif message["version"] > slot.version:
            self._follow(slot, message["path"], message["version"])

    def _follow(self, slot: ModelSlot, path: str, version: int) -> None:
        task = asyncio.create_task(self._reload_here(slot, path, version))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _reload_here(self, slot: ModelSlot, path: str, version: int) -> None:
        if slot.current is None and slot.loading is None and not slot.lock.locked():
            # Not loaded here: the next load takes the new version.
            slot.version, slot.path = version, path
            return
        try:
            await reload_slot(self.registry, slot, path, version)
        except ReloadRefused as exc:
            logger.error("%s", exc)

    async def close(self) -> None:
        for task in [self._watcher, *self._tasks]:
            if task is not None:
                task.cancel()
        for task in [self._watcher, *self._tasks]:
            if task is not None:
                with contextlib.suppress(BaseException):
                    await task


def _version_of(raw: bytes, what: str) -> dict | None:
    """{"name", "version", "path"} from a record or announcement; None (logged) if unreadable."""
    try:
        data = json.loads(raw)
        return {
            "name": str(data["name"]),
            "version": int(data["version"]),
            "path": str(data["path"]),
        }
    except (ValueError, KeyError, TypeError):
        logger.warning("ignoring %s: not a version record", what)
        return None
