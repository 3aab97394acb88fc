"""`ResilientStore`: keeps the service answering when the store backend is slow or down.

A cache miss or a skipped rate-limit check is better than a failed request, so every call gets a
deadline and a fallback answer, and a circuit breaker stops hammering a backend that is down.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import Literal, TypeVar

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode, Tracer

from rebar.store.base import (
    RateDecision,
    Store,
    StoreError,
    Subscription,
    check_rate_args,
    check_ttl,
    check_value,
)

T = TypeVar("T")

logger = logging.getLogger("rebar.store")


class ResilientStore:
    """Wraps any `Store` so that no call except `subscribe` raises for a backend failure, and none
    takes longer than `call_timeout_s` plus scheduling slack (`close` and `subscribe` allow at
    least a second).

    Callers may rely on:
    - a failed or timed-out call returning its fallback: `get` -> None (a miss); `set`, `delete`
      -> nothing happens; `set_if_absent` -> True (a waiter never deadlocks on a lock nobody can
      release); `ttl_ms` -> None; `rate_limit` -> allowed with `remaining=limit` and `reset_ms=0`
      when `on_error="allow"`, or denied with `remaining=0` and `reset_ms` = time until the next
      trial call when `on_error="deny"`; `publish` -> 0 (nobody was reached: the announcement is
      lost, as it would be with no subscriber);
    - `subscribe` always asking the backend (it bypasses the circuit, like `ping`: a subscription
      is long-lived, and one refused while the circuit is open would be missing long after the
      backend is back) and raising `StoreError` for any backend failure or timeout, because the
      caller has no fallback but to retry; the subscription it returns is the backend's own, so
      its iteration raises `StoreError` when the connection is lost, and the caller subscribes
      again;
    - the circuit opening after `failure_threshold` consecutive failures: for `open_for_s` seconds
      calls return fallbacks without touching the backend (`num_short_circuited` counts them);
      then one trial call goes through (others keep short-circuiting until it finishes); its
      success closes the circuit, its failure reopens it for another `open_for_s`. A backend that
      comes back is thus used again without a restart;
    - at most one warning on logger "rebar.store" per `open_for_s` interval while failing, and one
      info line when the backend recovers;
    - invalid arguments raising `ValueError` / `TypeError` as the `Store` contract says, whatever
      the circuit's state, and cancellation propagating: they are the caller's, not the backend's;
    - `ping` always asking the backend (it bypasses the circuit, for health checks) and returning
      False on failure or timeout.
    """

    def __init__(
        self,
        inner: Store,
        call_timeout_s: float = 0.25,
        failure_threshold: int = 3,
        open_for_s: float = 5.0,
        on_error: Literal["allow", "deny"] = "allow",
        clock: Callable[[], float] = time.monotonic,
        tracer: Tracer | None = None,
    ) -> None:
        if on_error not in ("allow", "deny"):
            raise ValueError(f"on_error must be 'allow' or 'deny', got {on_error!r}")
        if failure_threshold < 1:
            raise ValueError(f"failure_threshold must be >= 1, got {failure_threshold}")
        self.inner = inner
        self.call_timeout_s = call_timeout_s
        self.failure_threshold = failure_threshold
        self.open_for_s = open_for_s
        self.on_error = on_error
        self._clock = clock
        self._tracer = tracer or trace.NoOpTracer()
        self._backend = type(inner).__name__.removesuffix("Store").lower() or "store"
        self.num_errors = 0
        self.num_short_circuited = 0
        self._num_consecutive_failures = 0
        self._open_until: float | None = None  # None: circuit closed
        self._trial_in_flight = False
        self._last_logged_at: float | None = None

    @property
    def circuit_open(self) -> bool:
        """True from the moment the circuit opens until a successful call closes it."""
        return self._open_until is not None

    @property
    def state(self) -> Literal["closed", "open", "half_open"]:
        """'closed' (calls go through), 'open' (calls short-circuit), or 'half_open' (a trial is
        due)."""
        if self._open_until is None:
            return "closed"
        return "open" if self._clock() < self._open_until else "half_open"

    def _admit(self) -> tuple[bool, bool]:
        """(may call the backend, this call is the half-open trial)."""
        if self._open_until is None:
            return True, False
        if self._clock() < self._open_until or self._trial_in_flight:
            return False, False
        self._trial_in_flight = True
        return True, True

    def _on_failure(self, op: str, exc: BaseException) -> None:
        self.num_errors += 1
        self._num_consecutive_failures += 1
        now = self._clock()
        if self._open_until is not None or self._num_consecutive_failures >= self.failure_threshold:
            self._open_until = now + self.open_for_s
        if self._last_logged_at is None or now - self._last_logged_at >= self.open_for_s:
            self._last_logged_at = now
            reason = (
                "timed out" if isinstance(exc, TimeoutError) else f"{type(exc).__name__}: {exc}"
            )
            logger.warning(
                "store %s failed (%s); serving fallbacks "
                "(on_error=%s, %d errors so far, circuit %s)",
                op,
                reason,
                self.on_error,
                self.num_errors,
                self.state,
            )

    def _on_success(self) -> None:
        self._num_consecutive_failures = 0
        if self._open_until is not None:
            self._open_until = None
            self._last_logged_at = None
            logger.info("store backend recovered after %d errors; circuit closed", self.num_errors)

    async def _guarded(
        self, op: str, call: Callable[[], Awaitable[T]], fallback: Callable[[], T]
    ) -> T:
        # One client span per call: its outcome says whether the backend answered or a fallback did.
        with self._tracer.start_as_current_span(
            f"store {op}", kind=SpanKind.CLIENT, attributes={"db.system.name": self._backend}
        ) as span:
            admitted, is_trial = self._admit()
            if not admitted:
                self.num_short_circuited += 1
                span.set_attribute("rebar.store.outcome", "short_circuit")
                return fallback()
            try:
                async with asyncio.timeout(self.call_timeout_s):
                    result = await call()
            except (ValueError, TypeError):
                raise
            except Exception as exc:  # any backend failure, StoreError and timeouts included
                self._on_failure(op, exc)
                span.set_attribute(
                    "rebar.store.outcome", "timeout" if isinstance(exc, TimeoutError) else "error"
                )
                span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
                return fallback()
            finally:
                if is_trial:
                    self._trial_in_flight = False
            self._on_success()
            span.set_attribute("rebar.store.outcome", "ok")
            return result

    def _deny_reset_ms(self) -> int:
        if self._open_until is not None:
            return max(1, math.ceil((self._open_until - self._clock()) * 1000))
        return max(1, math.ceil(self.open_for_s * 1000))

    async def get(self, key: str) -> bytes | None:
        return await self._guarded("get", lambda: self.inner.get(key), lambda: None)

    async def set(self, key: str, value: bytes, ttl_ms: int | None = None) -> None:
        check_value(value)
        check_ttl(ttl_ms)
        await self._guarded("set", lambda: self.inner.set(key, value, ttl_ms), lambda: None)

    async def set_if_absent(self, key: str, value: bytes, ttl_ms: int | None = None) -> bool:
        check_value(value)
        check_ttl(ttl_ms)
        return await self._guarded(
            "set_if_absent", lambda: self.inner.set_if_absent(key, value, ttl_ms), lambda: True
        )

    async def delete(self, key: str) -> None:
        await self._guarded("delete", lambda: self.inner.delete(key), lambda: None)

    async def ttl_ms(self, key: str) -> int | None:
        return await self._guarded("ttl_ms", lambda: self.inner.ttl_ms(key), lambda: None)

    async def rate_limit(
        self, key: str, cost: int, limit: int, window_ms: int, *, clamp: bool = False
    ) -> RateDecision:
        check_rate_args(cost, limit, window_ms)

        def fallback() -> RateDecision:
            if self.on_error == "allow":
                return RateDecision(allowed=True, remaining=limit, reset_ms=0)
            return RateDecision(allowed=False, remaining=0, reset_ms=self._deny_reset_ms())

        return await self._guarded(
            "rate_limit",
            lambda: self.inner.rate_limit(key, cost, limit, window_ms, clamp=clamp),
            fallback,
        )

    async def publish(self, channel: str, message: bytes) -> int:
        check_value(message)
        return await self._guarded(
            "publish", lambda: self.inner.publish(channel, message), lambda: 0
        )

    async def subscribe(self, channel: str) -> Subscription:
        try:
            # Connecting a new socket and waiting for the confirmation may take longer than a call.
            async with asyncio.timeout(max(self.call_timeout_s, 1.0)):
                return await self.inner.subscribe(channel)
        except (StoreError, ValueError, TypeError):
            raise
        except Exception as exc:  # a timeout, or a backend error the inner store did not wrap
            if isinstance(exc, TimeoutError):
                raise StoreError(f"store subscribe {channel!r} timed out") from exc
            raise StoreError(
                f"store subscribe {channel!r} failed: {type(exc).__name__}: {exc}"
            ) from exc

    async def ping(self) -> bool:
        try:
            async with asyncio.timeout(self.call_timeout_s):
                return await self.inner.ping()
        except Exception:
            return False

    async def close(self) -> None:
        try:
            async with asyncio.timeout(max(self.call_timeout_s, 1.0)):
                await self.inner.close()
        except Exception as exc:
            logger.debug("closing store backend failed: %s", exc)
