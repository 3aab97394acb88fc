"""The gate every request passes before any work: its client's rate limits, and the waiting queue.

Identity is what a client cannot mint: the checked API key when keys are on, else the client's
address. Beyond `limits.max_waiting_requests` (or their prompt tokens) a request is refused at once
with a retry delay instead of queueing without bound; a generating request stops counting as
waiting once it produces its first output.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from starlette.requests import Request

from rebar.obs.tracing import Tracing
from rebar.server.context import request_context
from rebar.server.pipeline.call import Call, Next, Outcome
from rebar.server.pipeline.errors import RateLimited
from rebar.serving.errors import Overloaded
from rebar.store import RateLimiter

Spend = Callable[[int], Awaitable[bool]]  # charge generated tokens; False once they no longer fit


async def run(call: Call, next: Next) -> Outcome:
    """Down: the client's rate limits (the request's prompt tokens count against them). Up: their
    x-ratelimit-* headers on the response. The waiting room is entered by the generate stage,
    only when the engine is needed."""
    assert call.prepared is not None, "the prepare stage comes first"
    num_tokens = len(call.prepared.admitted.prompt_token_ids)
    passed = call.passed = await call.state.gate.admit(call.http, num_tokens)
    outcome = await next(call)
    outcome.headers.update(passed.headers)
    return outcome


class WaitingRoom:
    """Requests admitted but not yet producing output, and their prompt tokens, bounded."""

    def __init__(self, max_requests: int, max_prompt_tokens: int, retry_after_s: int) -> None:
        self.max_requests, self.max_prompt_tokens = max_requests, max_prompt_tokens
        self.retry_after_s = retry_after_s
        self.waiting_requests = 0
        self.waiting_prompt_tokens = 0
        self.num_rejected = 0

    def enter(self, num_prompt_tokens: int) -> Ticket:
        """A ticket to wait; raises Overloaded when either bound would be passed."""
        if (
            self.waiting_requests + 1 > self.max_requests
            or self.waiting_prompt_tokens + num_prompt_tokens > self.max_prompt_tokens
        ):
            self.num_rejected += 1
            raise Overloaded("the server is at capacity; retry later", self.retry_after_s)
        self.waiting_requests += 1
        self.waiting_prompt_tokens += num_prompt_tokens
        return Ticket(self, num_prompt_tokens)


@dataclass
class Ticket:
    room: WaitingRoom
    num_prompt_tokens: int
    released: bool = False

    def release(self) -> None:
        """The request started producing (or ended): it no longer counts as waiting. Idempotent."""
        if not self.released:
            self.released = True
            self.room.waiting_requests -= 1
            self.room.waiting_prompt_tokens -= self.num_prompt_tokens


@dataclass(frozen=True)
class Pass:
    """What the gate lets through: the rate limiter's x-ratelimit-* `headers`, the `tenant` whose
    caches the request may share, `spend` to charge its generated tokens (None: no token limit),
    and the waiting room it must `wait` in before it generates."""

    headers: dict[str, str]
    tenant: str | None
    spend: Spend | None
    room: WaitingRoom
    num_prompt_tokens: int

    def wait(self) -> Ticket:
        """A ticket in the waiting room; raises Overloaded when it is full."""
        return self.room.enter(self.num_prompt_tokens)


@dataclass
class Gate:
    """This server's limits: the rate limiter (None: no limit configured) and the waiting room."""

    limiter: RateLimiter | None
    waiting: WaitingRoom
    tracing: Tracing
    isolate_tenants: bool  # caches shared only within one client
    num_rate_limited: int = 0

    @staticmethod
    def client_id(request: Request) -> str:
        """The checked API key's id when keys are on, else the client's address (the socket's
        peer, or X-Forwarded-For only from `server.trusted_proxies`)."""
        key_id = request_context(request.scope).api_key_id
        if key_id:
            return key_id
        return "addr-" + (request.client.host if request.client else "unknown")

    def tenant(self, request: Request) -> str | None:
        """Whose caches this request may share: its client's when tenants are isolated, else
        everyone's (None)."""
        return self.client_id(request) if self.isolate_tenants else None

    async def admit(self, request: Request, num_prompt_tokens: int) -> Pass:
        """The request's pass; raises RateLimited when its client is over a limit."""
        return Pass(
            await self.check(request, num_prompt_tokens),
            self.tenant(request),
            self.token_spender(request),
            self.waiting,
            num_prompt_tokens,
        )

    async def check(self, request: Request, num_tokens: int) -> dict[str, str]:
        """OpenAI-style x-ratelimit-* headers; raises RateLimited when over a limit."""
        if self.limiter is None:
            return {}
        with self.tracing.tracer.start_as_current_span(
            "rate limit", attributes={"rebar.cost_tokens": num_tokens}
        ) as span:
            result = await self.limiter.check(self.client_id(request), num_tokens)
            span.set_attribute("rebar.rate_limit.allowed", result.allowed)
            if result.limited_by:
                span.set_attribute("rebar.rate_limit.limited_by", result.limited_by)
        if not result.allowed:
            self.num_rate_limited += 1
            raise RateLimited(
                f"rate limit reached for {result.limited_by}; retry after {result.retry_after_s}s",
                result.headers,
            )
        return result.headers

    def token_spender(self, request: Request) -> Spend | None:
        """Charges generated tokens to the client's tokens-per-minute limit while it generates;
        None without one."""
        limiter, identity = self.limiter, self.client_id(request)
        if limiter is None or limiter.limits_for(identity).tokens_per_minute is None:
            return None
        return lambda num_tokens: limiter.spend_tokens(identity, num_tokens)
