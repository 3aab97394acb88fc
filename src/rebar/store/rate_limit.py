"""Per-client request and token rate limits over any `Store`, with OpenAI-style headers.

Limits are fixed one-minute windows kept under `{prefix}:rl:{client_id}:req` and `...:tok`. With a
`RedisStore` every server process sharing the Redis server shares each client's limits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from rebar.store.base import RateDecision, Store

WINDOW_MS = 60_000


@dataclass(frozen=True)
class RateLimits:
    """Per-minute limits for one client; None means unlimited (and costs no store call)."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None

    def __post_init__(self) -> None:
        for name in ("requests_per_minute", "tokens_per_minute"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0 or None, got {value}")


@dataclass(frozen=True)
class RateLimitResult:
    """The answer to `RateLimiter.check`.

    `headers` holds `x-ratelimit-{limit,remaining,reset}-{requests,tokens}` for each limit that was
    checked (a limit that is None, or the token limit when the request limit already denied, adds
    none), plus `retry-after` (whole seconds) when denied. Reset values use `format_reset`.
    `retry_after_s` (whole seconds, >= 1) and `limited_by` are set only when denied.
    `too_large` is True when the request alone exceeds a limit, so retrying can never succeed.
    """

    allowed: bool
    headers: dict[str, str] = field(default_factory=dict)
    retry_after_s: int | None = None
    limited_by: Literal["requests", "tokens"] | None = None
    too_large: bool = False


def format_reset(ms: int) -> str:
    """Format a time until reset the way OpenAI's `x-ratelimit-reset-*` headers do.

    Under a second: whole milliseconds (`"850ms"`); under a minute: seconds with up to three
    decimals and no trailing zeros (`"12.3s"`, `"1s"`); otherwise minutes and seconds (`"1m0s"`,
    `"1m30.5s"`). Zero (or less) is `"0s"`.
    """
    if ms <= 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    minutes, rest_ms = divmod(ms, 60_000)
    seconds = f"{rest_ms / 1000:.3f}".rstrip("0").rstrip(".") + "s"
    return f"{minutes}m{seconds}" if minutes else seconds


def _headers(kind: str, limit: int, decision: RateDecision) -> dict[str, str]:
    return {
        f"x-ratelimit-limit-{kind}": str(limit),
        f"x-ratelimit-remaining-{kind}": str(decision.remaining),
        f"x-ratelimit-reset-{kind}": format_reset(decision.reset_ms),
    }


class RateLimiter:
    """Checks and charges per-client request and token limits.

    Callers may rely on:
    - `check` charging one request and `num_tokens` tokens only when both fit; a request denied by
      the request limit charges nothing; one denied by the token limit has used one request (as
      OpenAI counts unsuccessful requests) but no tokens;
    - `per_key[client_id]` replacing `default` entirely for that client;
    - each counter being atomic in the store, so concurrent requests never exceed a limit;
    - `spend_tokens` charging tokens as they are generated: False once they no longer fit, the
      counter then capped at the limit, so the client's remaining tokens reach 0, never below.
    """

    def __init__(
        self,
        store: Store,
        prefix: str = "rebar",
        default: RateLimits = RateLimits(),
        per_key: dict[str, RateLimits] | None = None,
    ) -> None:
        self.store = store
        self.prefix = prefix
        self.default = default
        self.per_key = dict(per_key or {})

    def limits_for(self, client_id: str) -> RateLimits:
        """The limits that apply to `client_id`."""
        return self.per_key.get(client_id, self.default)

    def _key(self, client_id: str, kind: Literal["req", "tok"]) -> str:
        return f"{self.prefix}:rl:{client_id}:{kind}"

    async def check(self, client_id: str, num_tokens: int) -> RateLimitResult:
        """Charge one request and `num_tokens` tokens to `client_id` if both fit this minute."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        limits = self.limits_for(client_id)
        headers: dict[str, str] = {}
        checks: list[
            tuple[Literal["requests", "tokens"], Literal["req", "tok"], int | None, int]
        ] = [
            ("requests", "req", limits.requests_per_minute, 1),
            ("tokens", "tok", limits.tokens_per_minute, num_tokens),
        ]
        for kind, suffix, limit, cost in checks:
            if limit is None:
                continue
            decision = await self.store.rate_limit(
                self._key(client_id, suffix), cost, limit, WINDOW_MS
            )
            headers.update(_headers(kind, limit, decision))
            if not decision.allowed:
                retry_after_s = max(1, math.ceil(decision.reset_ms / 1000))
                headers["retry-after"] = str(retry_after_s)
                return RateLimitResult(
                    allowed=False,
                    headers=headers,
                    retry_after_s=retry_after_s,
                    limited_by=kind,
                    too_large=cost > limit,
                )
        return RateLimitResult(allowed=True, headers=headers)

    async def spend_tokens(self, client_id: str, num_tokens: int) -> bool:
        """Charge `num_tokens` just generated for `client_id`; False when they did not fit this
        minute (the counter then stands at the limit), so the caller stops generating."""
        limit = self.limits_for(client_id).tokens_per_minute
        if limit is None or num_tokens <= 0:
            return True
        decision = await self.store.rate_limit(
            self._key(client_id, "tok"), num_tokens, limit, WINDOW_MS, clamp=True
        )
        return decision.allowed
