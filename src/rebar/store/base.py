"""The store interface: a small async key-value API shared by every backend.

Backends (`MemoryStore`, `RedisStore`, and the `ResilientStore` wrapper) all follow this contract,
and the shared test suite checks them against it:

- Keys are `str`; values are `bytes`. Nothing is encoded or pickled for the caller.
- TTLs are whole milliseconds and must be positive when given. A key whose TTL has passed is gone:
  `get` returns None and `set_if_absent` may take it.
- `rate_limit` counters are ordinary keys holding an ASCII decimal integer (so `get` on one returns
  e.g. `b"3"`); callers should give them their own key names.
- Backend failures (unreachable server, timeout, protocol error) raise `StoreError`; invalid
  arguments raise before any I/O: `ValueError` for a non-positive TTL or window or a negative
  cost or limit, `TypeError` for a value or message that is not bytes.
- Publish/subscribe is fire-and-forget, as in Redis: a message reaches the subscriptions of its
  channel that are open when it is published, in publish order; nothing is kept for later
  subscribers, and a subscription whose connection is lost raises `StoreError` rather than
  silently resubscribing (messages published meanwhile would be missed without anyone knowing).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import TracebackType
from typing import Protocol, runtime_checkable

from rebar.errors import RebarError


class StoreError(RebarError):
    """The store backend failed (unreachable, timed out, or answered with an error)."""


@dataclass(frozen=True)
class RateDecision:
    """The outcome of one `Store.rate_limit` call.

    `allowed`: the cost was added to the window's counter. `remaining`: how much of `limit` is
    left in the current window after this call (never negative). `reset_ms`: milliseconds until
    the current window ends and the counter starts again from zero; 0 when no window is running
    (only possible for a denied call on an unused key).
    """

    allowed: bool
    remaining: int
    reset_ms: int


@runtime_checkable
class Subscription(Protocol):
    """The messages published to one channel since `Store.subscribe` returned.

    Iterate it (`async for message in sub`) to receive each message's bytes in publish order.
    Iteration waits for the next message; it stops once the subscription is closed, and raises
    `StoreError` when the backend connection is lost (every message received before the loss is
    still yielded first; the caller then subscribes again, and re-reads any state it needs).
    Use it as an async context manager, or call `close`, to release it.
    """

    def __aiter__(self) -> Subscription: ...

    async def __anext__(self) -> bytes:
        """The next message; raises StopAsyncIteration once closed, StoreError once lost."""
        ...

    async def close(self) -> None:
        """Stop receiving and release the subscription's connection; safe to call again.

        Iterations waiting for a message end (StopAsyncIteration), and `publish` stops counting
        this subscription once `close` returns.
        """
        ...

    async def __aenter__(self) -> Subscription: ...

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None: ...


@runtime_checkable
class Store(Protocol):
    """Async key-value store with TTLs, an atomic NX set and an atomic fixed-window counter.

    Every method is a coroutine except where noted. Implementations are safe to call from many
    tasks of one event loop at once; each call is atomic with respect to other calls on the same
    backend (for Redis: across every client of the same server).
    """

    async def get(self, key: str) -> bytes | None:
        """The value stored at `key`, or None when the key is absent or expired."""
        ...

    async def set(self, key: str, value: bytes, ttl_ms: int | None = None) -> None:
        """Store `value` at `key`, replacing any value and TTL; `ttl_ms=None` means no expiry."""
        ...

    async def set_if_absent(self, key: str, value: bytes, ttl_ms: int | None = None) -> bool:
        """Store `value` only if `key` is absent (SET NX PX); True when this call stored it.

        Meant for short locks: give a TTL so a crashed holder cannot keep the lock forever.
        """
        ...

    async def delete(self, key: str) -> None:
        """Remove `key`; deleting an absent key is not an error."""
        ...

    async def ttl_ms(self, key: str) -> int | None:
        """Milliseconds until `key` expires; -1 when it has no expiry; None when it is absent."""
        ...

    async def rate_limit(
        self, key: str, cost: int, limit: int, window_ms: int, *, clamp: bool = False
    ) -> RateDecision:
        """Atomically charge `cost` against a fixed-window counter at `key`.

        The first charge on an absent key starts a window of `window_ms`; the counter disappears
        when the window ends. If `counter + cost <= limit`, the cost is added and the call is
        allowed. Otherwise the call is denied and nothing is added, so a request whose cost alone
        exceeds `limit` is always denied and never consumes quota.

        `clamp=True` charges usage that already happened (e.g. completion tokens): the cost is
        added even when it does not fit, but the counter is capped at `limit`, so `remaining`
        bottoms out at 0 and the next window starts clean. `allowed` then says whether all of
        the cost fitted.
        """
        ...

    async def publish(self, channel: str, message: bytes) -> int:
        """Deliver `message` to every subscription of `channel` open now; returns how many got it.

        For Redis this is PUBLISH's reply, counting subscribers in every process; for the memory
        store, this store's open subscriptions. 0 means nobody was listening (it is not an error).
        """
        ...

    async def subscribe(self, channel: str) -> Subscription:
        """Subscribe to `channel`; returns once the backend has confirmed the subscription.

        Every message published after this returns is received, so a caller can subscribe first,
        then read the state the messages announce changes to, and never miss a change.
        """
        ...

    async def ping(self) -> bool:
        """True when the backend answers; False (never an exception) when it does not."""
        ...

    async def close(self) -> None:
        """Close the store's subscriptions and release connections. The store must not be used
        afterwards."""
        ...


def check_ttl(ttl_ms: int | None) -> None:
    """Raise ValueError unless `ttl_ms` is None or a positive int (shared argument check)."""
    if ttl_ms is not None and (not isinstance(ttl_ms, int) or ttl_ms <= 0):
        raise ValueError(f"ttl_ms must be a positive integer or None, got {ttl_ms!r}")


def check_value(value: bytes) -> None:
    """Raise TypeError unless `value` is bytes, so every backend stores and returns the same
    type."""
    if not isinstance(value, bytes):
        raise TypeError(f"store values must be bytes, got {type(value).__name__}")


def check_rate_args(cost: int, limit: int, window_ms: int) -> None:
    """Raise ValueError for a negative cost or limit or a non-positive window."""
    if cost < 0:
        raise ValueError(f"cost must be >= 0, got {cost}")
    if limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    if window_ms <= 0:
        raise ValueError(f"window_ms must be > 0, got {window_ms}")
