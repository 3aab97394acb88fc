"""`RedisStore`: the store on a real Redis server, shared by every process that points at it.

Needs Redis 2.6+ (Lua scripting); tested against Redis 6.2.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import TypeVar, cast

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from rebar.store.base import RateDecision, StoreError, check_rate_args, check_ttl, check_value

T = TypeVar("T")

# KEYS[1] = counter; ARGV = cost, limit, window_ms, clamp (0/1). Returns {allowed, remaining,
# reset_ms}. The whole check-and-add runs inside Redis, so concurrent callers on any number of
# connections or processes can never push the counter past the limit together.
_RATE_LIMIT_LUA = """
local cost = tonumber(ARGV[1])
local limit = tonumber(ARGV[2])
local window = tonumber(ARGV[3])
local clamp = ARGV[4] == '1'
local raw = redis.call('GET', KEYS[1])
local current = 0
if raw then
  current = tonumber(raw)
  if not current then
    return redis.error_reply('ERR rate-limit counter is not an integer')
  end
end
local allowed = 0
local new = current
if current + cost <= limit then
  allowed = 1
  new = current + cost
elseif clamp then
  new = math.max(current, limit)
end
if allowed == 1 or clamp then
  redis.call('INCRBY', KEYS[1], new - current)
  current = new
  raw = true
end
local reset = 0
if raw then
  reset = redis.call('PTTL', KEYS[1])
  if reset < 0 then
    redis.call('PEXPIRE', KEYS[1], window)
    reset = window
  end
end
return {allowed, math.max(0, limit - current), reset}
"""


class RedisStore:
    """`Store` backed by a Redis server through `redis.asyncio` and one bounded connection pool.

    Callers may rely on:
    - every Redis error, refused connection and socket timeout surfacing as `StoreError` (there are
      no client-side retries, so a dead server fails fast instead of stalling the caller);
    - `rate_limit` being one Lua script run atomically by the server, so every process sharing the
      server shares the limit exactly;
    - at most `max_connections` sockets; extra concurrent calls wait up to `pool_timeout_s` for a
      free one, then fail with `StoreError`;
    - a restarted server being picked up again without recreating the store (broken pooled
      connections are reconnected on their next use).

    `url` is any redis-py URL (`redis://[:password@]host:port/db`, `rediss://...`, `unix://...`).
    Create and use the store from one event loop.
    """

    def __init__(
        self,
        url: str,
        socket_timeout_s: float = 0.25,
        max_connections: int = 64,
        pool_timeout_s: float = 1.0,
    ) -> None:
        pool = aioredis.BlockingConnectionPool.from_url(
            url,
            max_connections=max_connections,
            timeout=pool_timeout_s,
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=socket_timeout_s,
            retry=Retry(NoBackoff(), 0),
        )
        self._client = aioredis.Redis.from_pool(pool)
        self._rate_limit_script = self._client.register_script(_RATE_LIMIT_LUA)

    async def _call(self, op: str, awaitable: Awaitable[T]) -> T:
        try:
            return await awaitable
        except (RedisError, OSError) as exc:
            raise StoreError(f"redis {op} failed: {type(exc).__name__}: {exc}") from exc

    async def get(self, key: str) -> bytes | None:
        # The pool never decodes responses, so a value is bytes (redis-py's type says bytes or str).
        return cast("bytes | None", await self._call("GET", self._client.get(key)))

    async def set(self, key: str, value: bytes, ttl_ms: int | None = None) -> None:
        check_value(value)
        check_ttl(ttl_ms)
        await self._call("SET", self._client.set(key, value, px=ttl_ms))

    async def set_if_absent(self, key: str, value: bytes, ttl_ms: int | None = None) -> bool:
        check_value(value)
        check_ttl(ttl_ms)
        return bool(await self._call("SET NX", self._client.set(key, value, px=ttl_ms, nx=True)))

    async def delete(self, key: str) -> None:
        await self._call("DEL", self._client.delete(key))

    async def ttl_ms(self, key: str) -> int | None:
        pttl = int(await self._call("PTTL", self._client.pttl(key)))
        return None if pttl == -2 else pttl

    async def rate_limit(
        self, key: str, cost: int, limit: int, window_ms: int, *, clamp: bool = False
    ) -> RateDecision:
        check_rate_args(cost, limit, window_ms)
        args = [int(cost), int(limit), int(window_ms), 1 if clamp else 0]
        reply = await self._call("rate_limit", self._rate_limit_script(keys=[key], args=args))
        allowed, remaining, reset_ms = (int(x) for x in reply)
        return RateDecision(allowed=allowed == 1, remaining=remaining, reset_ms=reset_ms)

    async def ping(self) -> bool:
        try:
            return bool(await self._call("PING", self._client.ping()))
        except StoreError:
            return False

    async def close(self) -> None:
        await self._client.aclose()
