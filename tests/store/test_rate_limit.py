"""RateLimiter over both backends: request and token windows, headers, per-key limits."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import pytest

from rebar.store import MemoryStore, RateLimiter, RateLimits, Store, format_reset

if TYPE_CHECKING:
    from conftest import Backend


def test_allowed_request_reports_openai_headers(backend: Backend) -> None:
    async def body(store: Store) -> None:
        limiter = RateLimiter(
            store, "t", RateLimits(requests_per_minute=10, tokens_per_minute=1000)
        )
        result = await limiter.check("alice", 120)
        assert result.allowed and result.retry_after_s is None and result.limited_by is None
        headers = result.headers
        assert headers["x-ratelimit-limit-requests"] == "10"
        assert headers["x-ratelimit-remaining-requests"] == "9"
        assert headers["x-ratelimit-limit-tokens"] == "1000"
        assert headers["x-ratelimit-remaining-tokens"] == "880"
        for kind in ("requests", "tokens"):
            reset = headers[f"x-ratelimit-reset-{kind}"]
            assert reset == "1m0s" or 59 <= float(reset.removesuffix("s")) < 60, reset
        assert "retry-after" not in headers
        assert await store.get("t:rl:alice:req") == b"1"
        assert await store.get("t:rl:alice:tok") == b"120"

    backend.run(body)


def test_request_limit_denies_without_consuming_tokens(backend: Backend) -> None:
    async def body(store: Store) -> None:
        limiter = RateLimiter(store, "t", RateLimits(requests_per_minute=2, tokens_per_minute=1000))
        assert (await limiter.check("bob", 10)).allowed
        assert (await limiter.check("bob", 10)).allowed
        denied = await limiter.check("bob", 10)
        assert not denied.allowed and denied.limited_by == "requests" and not denied.too_large
        assert denied.headers["x-ratelimit-remaining-requests"] == "0"
        assert 1 <= denied.retry_after_s <= 60
        assert denied.headers["retry-after"] == str(denied.retry_after_s)
        assert "x-ratelimit-remaining-tokens" not in denied.headers
        assert await store.get("t:rl:bob:tok") == b"20"
        assert await store.get("t:rl:bob:req") == b"2"

    backend.run(body)


def test_token_limit_denies_and_keeps_token_quota(backend: Backend) -> None:
    async def body(store: Store) -> None:
        limiter = RateLimiter(
            store, "t", RateLimits(requests_per_minute=100, tokens_per_minute=100)
        )
        assert (await limiter.check("carol", 60)).allowed
        denied = await limiter.check("carol", 50)
        assert not denied.allowed and denied.limited_by == "tokens" and not denied.too_large
        assert denied.headers["x-ratelimit-remaining-tokens"] == "40"
        assert await store.get("t:rl:carol:tok") == b"60"
        # The request itself was counted, as OpenAI counts unsuccessful requests.
        assert denied.headers["x-ratelimit-remaining-requests"] == "98"
        assert (await limiter.check("carol", 40)).allowed
        huge = await limiter.check("dave", 101)
        assert not huge.allowed and huge.too_large and huge.retry_after_s >= 1
        assert await store.get("t:rl:dave:tok") is None

    backend.run(body)


def test_per_key_limits_replace_the_default(backend: Backend) -> None:
    async def body(store: Store) -> None:
        limiter = RateLimiter(
            store,
            "t",
            default=RateLimits(requests_per_minute=1),
            per_key={"vip": RateLimits(requests_per_minute=3, tokens_per_minute=None)},
        )
        assert limiter.limits_for("vip").requests_per_minute == 3
        assert [(await limiter.check("vip", 5)).allowed for _ in range(4)] == [
            True,
            True,
            True,
            False,
        ]
        assert [(await limiter.check("anon", 5)).allowed for _ in range(2)] == [True, False]
        assert "x-ratelimit-limit-tokens" not in (await limiter.check("vip", 5)).headers

    backend.run(body)


def test_spend_tokens_stops_at_the_limit_and_clamps(backend: Backend) -> None:
    async def body(store: Store) -> None:
        limiter = RateLimiter(store, "t", RateLimits(tokens_per_minute=100))
        assert (await limiter.check("erin", 90)).allowed
        assert [await limiter.spend_tokens("erin", 4) for _ in range(3)] == [True, True, False]
        assert (
            await store.get("t:rl:erin:tok") == b"100"
        )  # the one that did not fit stands at the limit
        assert not (await limiter.check("erin", 1)).allowed
        assert await limiter.spend_tokens("erin", 0)  # nothing spent, nothing refused
        assert (
            await limiter.spend_tokens("frank", 30) and await store.get("t:rl:frank:tok") == b"30"
        )
        unlimited = RateLimiter(store, "t", RateLimits(requests_per_minute=5))
        assert await unlimited.spend_tokens("erin", 10**9)

    backend.run(body)


def test_concurrent_spending_never_exceeds_the_limit(backend: Backend) -> None:
    async def body(store: Store) -> None:
        limiter = RateLimiter(store, "t", RateLimits(tokens_per_minute=50))
        spent = await asyncio.gather(*(limiter.spend_tokens("hal", 1) for _ in range(80)))
        assert sum(spent) == 50 and await store.get("t:rl:hal:tok") == b"50"

    backend.run(body)


def test_concurrent_checks_never_exceed_the_limit(backend: Backend) -> None:
    async def body(store: Store) -> None:
        limiter = RateLimiter(
            store, "t", RateLimits(requests_per_minute=1000, tokens_per_minute=500)
        )
        results = await asyncio.gather(*(limiter.check("gina", 30) for _ in range(40)))
        assert sum(r.allowed for r in results) == 16  # 16 * 30 = 480 <= 500 < 17 * 30
        assert await store.get("t:rl:gina:tok") == b"480"

    backend.run(body)


class _NoCallsStore(MemoryStore):
    async def rate_limit(self, *args: object, **kwargs: object):  # type: ignore[override]
        raise AssertionError("unlimited clients must not touch the store")


def test_unlimited_makes_no_store_call() -> None:
    async def main() -> None:
        limiter = RateLimiter(_NoCallsStore(), "t", RateLimits())
        result = await limiter.check("anyone", 10**9)
        assert result.allowed and result.headers == {}
        assert await limiter.spend_tokens("anyone", 10**9)

    asyncio.run(main())


def test_invalid_limits_and_tokens_raise() -> None:
    with pytest.raises(ValueError):
        RateLimits(requests_per_minute=-1)
    with pytest.raises(ValueError):
        asyncio.run(RateLimiter(MemoryStore(), "t", RateLimits(tokens_per_minute=5)).check("x", -1))


@pytest.mark.parametrize(
    ("ms", "text"),
    [
        (0, "0s"),
        (17, "17ms"),
        (850, "850ms"),
        (1000, "1s"),
        (12_300, "12.3s"),
        (12_345, "12.345s"),
        (59_999, "59.999s"),
        (60_000, "1m0s"),
        (90_500, "1m30.5s"),
        (360_000, "6m0s"),
    ],
)
def test_format_reset(ms: int, text: str) -> None:
    assert format_reset(ms) == text
