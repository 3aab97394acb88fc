"""`QueuedSubscription`: the `Subscription` both backends hand out, fed through a bounded queue.

The backend pushes each message with `deliver` (the memory store from `publish`, the Redis store
from a task reading the subscription's connection), so a slow reader never blocks a publisher or
the connection: when it falls `max_pending` messages behind, the oldest are dropped.
"""

from __future__ import annotations

import asyncio
import logging
from types import TracebackType
from typing import Final

from rebar.store.base import StoreError

logger = logging.getLogger("rebar.store")

DEFAULT_MAX_PENDING = 1024

# Queued after the last message once the subscription has ended (closed or lost); it is put back
# whenever it is taken, so every later or concurrent reader sees the end too.
_END: Final = object()


class QueuedSubscription:
    """A subscription to `channel` whose messages wait in a queue of at most `max_pending`.

    Subclasses release their backend resources in `_release`, which `close` calls once.
    """

    def __init__(self, channel: str, max_pending: int = DEFAULT_MAX_PENDING) -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        self.channel = channel
        self.max_pending = max_pending
        self.num_dropped = 0  # messages dropped because the reader fell behind
        self._queue: asyncio.Queue[object] = asyncio.Queue()  # bounded by `deliver`, not maxsize
        self._closed = False
        self._ended = False  # closed or lost: nothing more is delivered
        self._error: StoreError | None = None

    @property
    def closed(self) -> bool:
        return self._closed

    def deliver(self, message: bytes) -> None:
        """Queue `message` for the reader, dropping the oldest one when `max_pending` wait."""
        if self._ended:
            return
        if self._queue.qsize() >= self.max_pending:
            self._queue.get_nowait()
            self.num_dropped += 1
            if self.num_dropped == 1:  # once per subscription: a stuck reader must not flood logs
                logger.warning(
                    "subscription to %r fell %d messages behind; dropping the oldest ones",
                    self.channel,
                    self.max_pending,
                )
        self._queue.put_nowait(message)

    def fail(self, error: StoreError) -> None:
        """The backend connection is lost: the reader gets what is queued, then `error`."""
        if self._ended:
            return
        self._ended = True
        self._error = error
        self._queue.put_nowait(_END)

    def __aiter__(self) -> QueuedSubscription:
        return self

    async def __anext__(self) -> bytes:
        if self._closed:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, bytes):
            return item
        self._queue.put_nowait(item)
        if self._error is not None and not self._closed:
            raise self._error
        raise StopAsyncIteration

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = self._ended = True
        # Unread messages are discarded; waiting readers wake up to the end marker.
        while not self._queue.empty():
            self._queue.get_nowait()
        self._queue.put_nowait(_END)
        await self._release()

    async def _release(self) -> None:
        """Give the backend's resources back (called once, by `close`)."""

    async def __aenter__(self) -> QueuedSubscription:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.close()
