"""Stored responses of the Responses API (`store: true`, the default) and its background runs.

A stored response lives in rebar's store (in-process, or Redis shared by every replica) under
`<prefix>:responses:<tenant>:<id>` for `responses.store_ttl_s`, as JSON: the response object as
GET returns it, the request's input items, and the items of the conversation before them (what
`previous_response_id` continues). The tenant is the API key's id when keys are on, so another
key's id is simply not found; with keys off every client shares one space. A record over
`responses.max_stored_bytes` is not stored (the response itself is still returned).

A background run is a task of the replica that started it. Cancelling it there cancels the task
(aborting its engine request); from another replica, the cancel is published on
`<prefix>:responses:cancel` and the replica running it cancels it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any

from rebar.store import Store, StoreError

logger = logging.getLogger("rebar.server")

NO_TENANT = "-"  # API keys off: one space for every client
RESUBSCRIBE_S = 1.0


@dataclass
class ResponseStore:
    store: Store
    prefix: str
    ttl_s: float
    max_bytes: int

    def _key(self, tenant: str | None, response_id: str) -> str:
        return f"{self.prefix}:responses:{tenant or NO_TENANT}:{response_id}"

    async def put(self, tenant: str | None, record: dict[str, Any]) -> bool:
        """Store `record` (its `response.id` names it); False when it is over the byte bound."""
        data = json.dumps(record, ensure_ascii=False).encode()
        if len(data) > self.max_bytes:
            logger.warning(
                "response %s not stored: %d bytes, over responses.max_stored_bytes (%d)",
                record["response"]["id"],
                len(data),
                self.max_bytes,
            )
            return False
        key = self._key(tenant, record["response"]["id"])
        await self.store.set(key, data, int(self.ttl_s * 1000))
        return True

    async def get(self, tenant: str | None, response_id: str) -> dict[str, Any] | None:
        raw = await self.store.get(self._key(tenant, response_id))
        if raw is None:
            return None
        try:
            record = json.loads(raw)
        except ValueError:
            logger.warning("stored response %s is not JSON; treated as missing", response_id)
            return None
        return record if isinstance(record, dict) else None

    async def delete(self, tenant: str | None, response_id: str) -> bool:
        key = self._key(tenant, response_id)
        if await self.store.get(key) is None:
            return False
        await self.store.delete(key)
        return True


@dataclass
class BackgroundRuns:
    """This replica's background runs, and cancels from any replica."""

    store: Store
    channel: str
    _tasks: dict[str, asyncio.Task] = field(default_factory=dict)
    _watcher: asyncio.Task | None = None

    def start(self, response_id: str, work: Awaitable[Any]) -> None:
        """Run `work` detached (it records its own outcome, cancellation included)."""

        async def run() -> None:
            try:
                await work
            finally:
                self._tasks.pop(response_id, None)

        self._tasks[response_id] = asyncio.create_task(run(), name=f"rebar-response-{response_id}")

    def running_here(self, response_id: str) -> bool:
        return response_id in self._tasks

    async def cancel(self, response_id: str) -> None:
        """Cancel the run wherever it runs: here at once, elsewhere through the store."""
        if not self._cancel_here(response_id):
            await self.store.publish(self.channel, response_id.encode())

    def _cancel_here(self, response_id: str) -> bool:
        task = self._tasks.get(response_id)
        if task is None:
            return False
        task.cancel()
        return True

    def watch(self) -> None:
        """Listen for cancels published by other replicas (until `close`)."""
        self._watcher = asyncio.create_task(self._watch(), name="rebar-response-cancels")

    async def _watch(self) -> None:
        while True:
            try:
                subscription = await self.store.subscribe(self.channel)
            except StoreError as exc:
                logger.warning("cannot subscribe to response cancels (%s); retrying", exc)
                await asyncio.sleep(RESUBSCRIBE_S)
                continue
            try:
                async for message in subscription:
                    self._cancel_here(message.decode("utf-8", "replace"))
            except StoreError as exc:
                logger.warning("response cancel subscription lost (%s); subscribing again", exc)
            finally:
                with contextlib.suppress(Exception):
                    await subscription.close()
            await asyncio.sleep(RESUBSCRIBE_S)

    async def close(self) -> None:
        """Stop listening and cancel every run of this replica (at shutdown)."""
        tasks = [t for t in (self._watcher, *self._tasks.values()) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task
