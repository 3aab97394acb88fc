"""`RedisStore`: the store on a real Redis server, shared by every process that points at it.

Needs Redis 2.6+ (Lua scripting); tested against Redis 6.2.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, cast

import redis.asyncio as aioredis
from redis.asyncio.client import PubSub
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from rebar.store.base import (
    RateDecision,
    StoreError,
    Subscription,
    check_rate_args,
    check_ttl,
    check_value,
)
from rebar.store.subscription import DEFAULT_MAX_PENDING, QueuedSubscription

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


class _RedisSubscription(QueuedSubscription):
    """A subscription on its own connection, read by a task that feeds the queue.

    The task reads with short timeouts (never the pool's socket timeout, which an idle channel
    would trip) and PINGs the server after `ping_s` of silence, so a server that died or hangs is
    noticed within about 2 * `ping_s` and the reader gets a StoreError instead of waiting forever.
    """

    def __init__(
        self,
        channel: str,
        pubsub: PubSub,
        max_pending: int,
        ping_s: float,
        timeout_s: float,
        forget: Callable[[_RedisSubscription], None],
    ) -> None:
        super().__init__(channel, max_pending)
        self._pubsub = pubsub
        self._ping_s = ping_s
        self._timeout_s = timeout_s
        self._forget = forget
        self._reader: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._reader = asyncio.create_task(
            self._read(), name=f"rebar.store subscription {self.channel!r}"
        )

    async def _read(self) -> None:
        try:
            await self._read_forever()
        except Exception as exc:  # any failure ends the subscription; the reader must hear of it
            if not isinstance(exc, StoreError):
                exc = StoreError(
                    f"redis subscription to {self.channel!r} lost: {type(exc).__name__}: {exc}"
                )
            self.fail(exc)
            # Drop the broken connection now: left alone, redis-py would reconnect and resubscribe
            # on its next use, hiding the gap in which messages were lost.
            await _quietly(self._pubsub.aclose())

    async def _read_forever(self) -> None:
        loop = asyncio.get_running_loop()
        heard_at = loop.time()
        ping_sent_at: float | None = None
        while True:
            now = loop.time()
            if ping_sent_at is not None:
                if now - ping_sent_at >= self._ping_s:
                    raise StoreError(
                        f"redis did not answer a PING on the subscription to {self.channel!r} "
                        f"within {self._ping_s}s"
                    )
                wait_s = ping_sent_at + self._ping_s - now
            elif now - heard_at >= self._ping_s:
                await self._pubsub.ping()
                ping_sent_at = now
                continue
            else:
                wait_s = heard_at + self._ping_s - now
            reply = await self._pubsub.get_message(timeout=wait_s)
            if reply is None:  # nothing within wait_s
                continue
            # Any reply (a message, the PING's pong) shows the connection is alive.
            heard_at, ping_sent_at = loop.time(), None
            if reply["type"] == "message":
                self.deliver(reply["data"])

    async def _release(self) -> None:
        self._forget(self)
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.wait([self._reader])  # not `await task`: its CancelledError is expected
        if self._error is None:
            # UNSUBSCRIBE and wait for the confirmation, so a PUBLISH after `close` returns no
            # longer counts this subscription (a bare disconnect is noticed by the server later).
            await _quietly(self._unsubscribe())
        await _quietly(self._pubsub.aclose())

    async def _unsubscribe(self) -> None:
        async with asyncio.timeout(self._timeout_s):
            await self._pubsub.unsubscribe()
            while True:
                reply = await self._pubsub.get_message(timeout=None)
                if reply is not None and reply["type"] == "unsubscribe":
                    return


async def _quietly(awaitable: Awaitable[Any]) -> None:
    """Await a best-effort cleanup step, ignoring backend failures (cancellation propagates)."""
    try:
        await awaitable
    except (RedisError, OSError):
        pass


class RedisStore:
    """`Store` backed by a Redis server through `redis.asyncio`: one bounded connection pool for
    calls, plus one connection per subscription.

    Callers may rely on:
    - every Redis error, refused connection and socket timeout surfacing as `StoreError` (there are
      no client-side retries, so a dead server fails fast instead of stalling the caller);
    - `rate_limit` being one Lua script run atomically by the server, so every process sharing the
      server shares the limit exactly;
    - at most `max_connections` sockets for calls; extra concurrent calls wait up to
      `pool_timeout_s` for a free one, then fail with `StoreError`;
    - a restarted server being picked up again without recreating the store (broken pooled
      connections are reconnected on their next use);
    - each subscription having its own connection, outside the pool (so subscriptions never
      starve get/set of connections), confirmed by the server before `subscribe` returns and
      read by a background task into a queue of at most `max_pending_messages` (the oldest are
      dropped beyond that); an idle subscription PINGs the server every
      `subscription_ping_s`, so a dead or hung server or a lost connection makes its iteration
      raise `StoreError` within about twice that, and it is never silently resubscribed;
    - `close` closing every subscription first.

    `url` is any redis-py URL (`redis://[:password@]host:port/db`, `rediss://...`, `unix://...`).
    Create and use the store from one event loop.
    """

    def __init__(
        self,
        url: str,
        socket_timeout_s: float = 0.25,
        max_connections: int = 64,
        pool_timeout_s: float = 1.0,
        max_pending_messages: int = DEFAULT_MAX_PENDING,
        subscription_ping_s: float = 1.0,
    ) -> None:
        if max_pending_messages < 1:
            raise ValueError(f"max_pending_messages must be >= 1, got {max_pending_messages}")
        if subscription_ping_s <= 0:
            raise ValueError(f"subscription_ping_s must be > 0, got {subscription_ping_s}")
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
        # Subscriptions hold their connection for as long as they live, so they get an unbounded
        # pool of their own rather than taking sockets from the one above.
        pubsub_pool = aioredis.ConnectionPool.from_url(
            url,
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=socket_timeout_s,
            retry=Retry(NoBackoff(), 0),
        )
        self._pubsub_client = aioredis.Redis.from_pool(pubsub_pool)
        self._socket_timeout_s = socket_timeout_s
        self.max_pending_messages = max_pending_messages
        self.subscription_ping_s = subscription_ping_s
        self._subscriptions: set[_RedisSubscription] = set()

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

    async def publish(self, channel: str, message: bytes) -> int:
        check_value(message)
        return int(await self._call("PUBLISH", self._client.publish(channel, message)))

    async def subscribe(self, channel: str) -> Subscription:
        pubsub = self._pubsub_client.pubsub()
        try:
            # Connecting plus one reply: each step may take up to the socket timeout.
            async with asyncio.timeout(2 * self._socket_timeout_s):
                await pubsub.subscribe(channel)
                # The confirmation is the connection's first reply; from then on the server
                # delivers every PUBLISH to the channel.
                while True:
                    reply = await pubsub.get_message(timeout=None)
                    if reply is not None and reply["type"] == "subscribe":
                        break
        except BaseException as exc:
            await _quietly(pubsub.aclose())
            if isinstance(exc, RedisError | OSError):  # TimeoutError is an OSError
                raise StoreError(
                    f"redis SUBSCRIBE {channel!r} failed: {type(exc).__name__}: {exc}"
                ) from exc
            raise
        subscription = _RedisSubscription(
            channel,
            pubsub,
            self.max_pending_messages,
            self.subscription_ping_s,
            self._socket_timeout_s,
            self._subscriptions.discard,
        )
        self._subscriptions.add(subscription)
        subscription.start()
        return subscription

    async def ping(self) -> bool:
        try:
            return bool(await self._call("PING", self._client.ping()))
        except StoreError:
            return False

    async def close(self) -> None:
        await asyncio.gather(*(sub.close() for sub in list(self._subscriptions)))
        await self._pubsub_client.aclose()
        await self._client.aclose()
