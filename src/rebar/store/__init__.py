"""Side-service storage: response and embedding caches, rate-limit counters, locks, and
publish/subscribe for events between server processes.

`MemoryStore` (in-process, the default, nothing to start) and `RedisStore` (a real Redis server,
shared by every process) implement the `Store` protocol; `ResilientStore` wraps either so backend
failures degrade to fallbacks instead of errors. `RedisStore` is imported lazily, so using the
memory store never imports redis-py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rebar.store.base import RateDecision, Store, StoreError, Subscription
from rebar.store.memory import MemoryStore
from rebar.store.rate_limit import RateLimiter, RateLimitResult, RateLimits, format_reset
from rebar.store.resilient import ResilientStore

if TYPE_CHECKING:
    from rebar.store.redis import RedisStore

__all__ = [
    "MemoryStore",
    "RateDecision",
    "RateLimitResult",
    "RateLimiter",
    "RateLimits",
    "RedisStore",
    "ResilientStore",
    "Store",
    "StoreError",
    "Subscription",
    "format_reset",
    "open_store",
]


def open_store(url: str = "memory://", **options: Any) -> Store:
    """Open the backend a URL names: `memory://` (or `memory`) -> `MemoryStore(**options)`;
    `redis://`, `rediss://`, `unix://` -> `RedisStore(url, **options)`. Raises ValueError otherwise.

    The store is returned bare; wrap it in `ResilientStore` where failures must not surface.
    """
    if url in ("memory", "memory://"):
        return MemoryStore(**options)
    if url.startswith(("redis://", "rediss://", "unix://")):
        from rebar.store.redis import RedisStore

        return RedisStore(url, **options)
    scheme = url.split("://", 1)[0] if "://" in url else url
    raise ValueError(f"unknown store backend {scheme!r}: use 'memory://' or a redis:// URL")


def __getattr__(name: str) -> Any:
    if name == "RedisStore":
        from rebar.store.redis import RedisStore

        return RedisStore
    raise AttributeError(f"module 'rebar.store' has no attribute {name!r}")
