"""`MemoryStore`: the embedded default store, a dict in this process.

Nothing to start and nothing shared: each process has its own data, so limits and caches are per
process, and a published message reaches only this store's subscriptions. Use `RedisStore` when
several server processes must share them.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable

from rebar.store.base import (
    RateDecision,
    StoreError,
    Subscription,
    check_rate_args,
    check_ttl,
    check_value,
)
from rebar.store.subscription import DEFAULT_MAX_PENDING, QueuedSubscription


class _MemorySubscription(QueuedSubscription):
    def __init__(self, store: MemoryStore, channel: str, max_pending: int) -> None:
        super().__init__(channel, max_pending)
        self._store = store

    async def _release(self) -> None:
        self._store._forget(self)


class MemoryStore:
    """In-process `Store` with monotonic-clock expiry and a bounded size.

    Callers may rely on:
    - the `Store` contract, including atomic `set_if_absent` and `rate_limit`: no method awaits,
      so each call runs to completion without another task of the event loop interleaving;
    - expiry measured on `clock` (default `time.monotonic`), so wall-clock jumps do not matter;
      expired keys are dropped lazily when touched and as the oldest entries are evicted;
    - at most `max_entries` keys and `max_bytes` of keys plus values: a write that would exceed
      either evicts the least recently written keys first (a lock or counter can therefore vanish
      under memory pressure, as in Redis with an eviction policy); a single value larger than
      `max_bytes` is a StoreError;
    - `publish` handing the message to each open subscription of the channel before it returns
      (the count is theirs); each subscription queues up to `max_pending_messages` unread
      messages, then drops the oldest (logging one warning on "rebar.store" per subscription);
      `close` closes every subscription;
    - not thread-safe: use it from one event loop.
    """

    def __init__(
        self,
        max_entries: int = 100_000,
        max_bytes: int = 256 * 2**20,
        clock: Callable[[], float] = time.monotonic,
        max_pending_messages: int = DEFAULT_MAX_PENDING,
    ) -> None:
        if max_entries < 1 or max_bytes < 1:
            raise ValueError(
                f"max_entries and max_bytes must be >= 1, got {max_entries} and {max_bytes}"
            )
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._clock = clock
        # key -> (value, expires_at on self._clock or None); order = oldest write first.
        self._entries: OrderedDict[str, tuple[bytes, float | None]] = OrderedDict()
        self.num_bytes = 0  # keys and values held
        self.num_evicted = 0
        if max_pending_messages < 1:
            raise ValueError(f"max_pending_messages must be >= 1, got {max_pending_messages}")
        self.max_pending_messages = max_pending_messages
        # channel -> its open subscriptions, in subscription order (a dict as an ordered set).
        self._subscriptions: dict[str, dict[_MemorySubscription, None]] = {}

    def __len__(self) -> int:
        """Number of entries held, counting expired ones not yet dropped."""
        return len(self._entries)

    def _live(self, key: str) -> tuple[bytes, float | None] | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        expires_at = entry[1]
        if expires_at is not None and expires_at <= self._clock():
            self._drop(key)
            return None
        return entry

    @staticmethod
    def _size(key: str, value: bytes) -> int:
        return len(key) + len(value)

    def _drop(self, key: str) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.num_bytes -= self._size(key, entry[0])

    def _write(self, key: str, value: bytes, expires_at: float | None) -> None:
        if self._size(key, value) > self.max_bytes:
            raise StoreError(
                f"a value of {len(value)} bytes exceeds the "
                f"store's budget of {self.max_bytes} bytes"
            )
        self._drop(key)
        self._entries[key] = (value, expires_at)
        self.num_bytes += self._size(key, value)
        while len(self._entries) > self.max_entries or self.num_bytes > self.max_bytes:
            oldest = next(iter(self._entries))
            self._drop(oldest)
            self.num_evicted += 1

    def _expiry(self, ttl_ms: int | None) -> float | None:
        return None if ttl_ms is None else self._clock() + ttl_ms / 1000.0

    def _remaining_ms(self, expires_at: float | None) -> int:
        if expires_at is None:
            return -1
        return max(1, math.ceil((expires_at - self._clock()) * 1000.0))

    async def get(self, key: str) -> bytes | None:
        entry = self._live(key)
        return None if entry is None else entry[0]

    async def set(self, key: str, value: bytes, ttl_ms: int | None = None) -> None:
        check_value(value)
        check_ttl(ttl_ms)
        self._write(key, value, self._expiry(ttl_ms))

    async def set_if_absent(self, key: str, value: bytes, ttl_ms: int | None = None) -> bool:
        check_value(value)
        check_ttl(ttl_ms)
        if self._live(key) is not None:
            return False
        self._write(key, value, self._expiry(ttl_ms))
        return True

    async def delete(self, key: str) -> None:
        self._drop(key)

    async def ttl_ms(self, key: str) -> int | None:
        entry = self._live(key)
        return None if entry is None else self._remaining_ms(entry[1])

    async def rate_limit(
        self, key: str, cost: int, limit: int, window_ms: int, *, clamp: bool = False
    ) -> RateDecision:
        check_rate_args(cost, limit, window_ms)
        entry = self._live(key)
        current = 0
        expires_at: float | None = None
        if entry is not None:
            try:
                current = int(entry[0])
            except ValueError:
                raise StoreError(f"rate-limit counter {key!r} does not hold an integer") from None
            expires_at = entry[1]
        allowed = current + cost <= limit
        if allowed or clamp:
            new = current + cost if allowed else max(current, limit)
            if entry is None or expires_at is None:
                # A new window; also repairs a counter that somehow lost its expiry.
                expires_at = self._expiry(window_ms)
            self._write(key, str(new).encode(), expires_at)
            current = new
        elif entry is not None and expires_at is None:
            expires_at = self._expiry(window_ms)
            self._write(key, entry[0], expires_at)
        reset_ms = 0 if expires_at is None else self._remaining_ms(expires_at)
        return RateDecision(allowed=allowed, remaining=max(0, limit - current), reset_ms=reset_ms)

    async def publish(self, channel: str, message: bytes) -> int:
        check_value(message)
        subscriptions = self._subscriptions.get(channel, {})
        for subscription in subscriptions:
            subscription.deliver(message)
        return len(subscriptions)

    async def subscribe(self, channel: str) -> Subscription:
        subscription = _MemorySubscription(self, channel, self.max_pending_messages)
        self._subscriptions.setdefault(channel, {})[subscription] = None
        return subscription

    def _forget(self, subscription: _MemorySubscription) -> None:
        subscriptions = self._subscriptions.get(subscription.channel, {})
        subscriptions.pop(subscription, None)
        if not subscriptions:
            self._subscriptions.pop(subscription.channel, None)

    async def ping(self) -> bool:
        return True

    async def close(self) -> None:
        for subscriptions in list(self._subscriptions.values()):
            for subscription in list(subscriptions):
                await subscription.close()
        self._entries.clear()
        self.num_bytes = 0
