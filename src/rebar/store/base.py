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
  cost or limit, `TypeError` for a value that is not bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
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

    async def ping(self) -> bool:
        """True when the backend answers; False (never an exception) when it does not."""
        ...

    async def close(self) -> None:
        """Release connections. The store must not be used afterwards."""
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
