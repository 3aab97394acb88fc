"""What chat and completions share around generation: rate limits, the response cache, and the
neutral `Completion` that both fresh answers and cache hits are rendered from."""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from starlette.requests import Request

from rebar.engine.outputs import Choice, OutputAccumulator
from rebar.engine.sampler import TokenLogprobs
from rebar.engine.sampling_params import SamplingParams
from rebar.server.context import request_context
from rebar.server.errors import APIError
from rebar.server.response_cache import Lead
from rebar.server.state import ServerState
from rebar.timing import RequestTiming


@dataclass(frozen=True)
class Completion:
    """A finished answer in a form both endpoints render, and the cache stores as JSON.

    Choices replayed from the cache carry no token ids: it keeps their text, logprobs and how they
    finished, and the completion's token count.
    """

    choices: tuple[Choice, ...]
    num_prompt_tokens: int
    num_completion_tokens: int
    num_cached_tokens: int = 0
    timing: RequestTiming | None = None  # the engine's; None for a cache hit (never stored)

    @classmethod
    def from_outputs(cls, outputs: OutputAccumulator, num_prompt_tokens: int) -> Completion:
        return cls(
            outputs.choices(),
            num_prompt_tokens,
            outputs.num_completion_tokens,
            outputs.num_cached_tokens,
            outputs.timing(),
        )

    @property
    def cacheable(self) -> bool:
        return all(c.finish_reason in ("stop", "length") for c in self.choices)

    def to_json(self) -> dict:
        return {
            "choices": [
                {
                    "index": c.index,
                    "text": c.text,
                    "finish_reason": c.finish_reason,
                    "logprobs": [
                        [e.token_id, e.logprob, [list(t) for t in e.top]] for e in c.logprobs
                    ],
                }
                for c in self.choices
            ],
            "usage": [self.num_prompt_tokens, self.num_completion_tokens],
        }

    @classmethod
    def from_json(cls, data: dict, num_prompt_tokens: int) -> Completion:
        choices = tuple(
            Choice(
                c["index"],
                c["text"],
                [],
                c["finish_reason"],
                logprobs=tuple(
                    TokenLogprobs(t, lp, tuple((a, b) for a, b in top))
                    for t, lp, top in c["logprobs"]
                ),
            )
            for c in data["choices"]
        )
        # A hit computes nothing: every prompt token counts as cached.
        return cls(choices, num_prompt_tokens, data["usage"][1], num_prompt_tokens)


def client_id(request: Request) -> str:
    """Rate-limit identity, which a client cannot mint: the checked API key when keys are on, else
    the client's address (the socket's peer, or X-Forwarded-For only from
    `server.trusted_proxies`)."""
    key_id = request_context(request.scope).api_key_id
    if key_id:
        return key_id
    return "addr-" + (request.client.host if request.client else "unknown")


def tenant(state: ServerState, request: Request) -> str | None:
    """Whose caches this request may share: its client's when tenants are isolated, else everyone's
    (None)."""
    return client_id(request) if state.isolate_tenants else None


async def check_rate_limit(state: ServerState, request: Request, num_tokens: int) -> dict[str, str]:
    """OpenAI-style x-ratelimit-* headers; raises 429 with Retry-After when over a limit."""
    if state.rate_limiter is None:
        return {}
    with state.tracing.tracer.start_as_current_span(
        "rate limit", attributes={"rebar.cost_tokens": num_tokens}
    ) as span:
        result = await state.rate_limiter.check(client_id(request), num_tokens)
        span.set_attribute("rebar.rate_limit.allowed", result.allowed)
        if result.limited_by:
            span.set_attribute("rebar.rate_limit.limited_by", result.limited_by)
    if not result.allowed:
        state.num_rate_limited += 1
        raise APIError(
            429,
            f"rate limit reached for {result.limited_by}; retry after {result.retry_after_s}s",
            code="rate_limit_exceeded",
            headers=result.headers,
        )
    return result.headers


def token_spender(state: ServerState, request: Request) -> Callable[[int], Awaitable[bool]] | None:
    """Charges generated tokens to the client's tokens-per-minute limit while it generates; None
    without one."""
    limiter, identity = state.rate_limiter, client_id(request)
    if limiter is None or limiter.limits_for(identity).tokens_per_minute is None:
        return None
    return lambda num_tokens: limiter.spend_tokens(identity, num_tokens)


def canonical_request(
    endpoint: str, prompt_ids: list[int], params: SamplingParams, extra: dict | None = None
) -> dict:
    """The fields that change the output (not `stream`, not usage options), in a stable form."""
    fields = {f.name: getattr(params, f.name) for f in dataclasses.fields(params)}
    fields["logit_bias"] = sorted((params.logit_bias or {}).items())
    fields["stop"], fields["stop_token_ids"] = list(params.stop), list(params.stop_token_ids)
    if params.structured is not None:
        fields["structured"] = dataclasses.asdict(params.structured)
    return {"endpoint": endpoint, "prompt": prompt_ids, "params": fields, **(extra or {})}


def is_deterministic(params: SamplingParams) -> bool:
    return params.temperature == 0 or params.seed is not None


async def cache_lookup(
    state: ServerState, request: Request, model: str, canonical: dict, params: SamplingParams
) -> tuple[dict | None, Lead | None, str | None]:
    """(cached value, lead, X-Cache header). No cache, a random request or `Cache-Control: no-cache`
    skip the read; a no-cache request still refreshes the entry."""
    cache = state.response_cache
    if cache is None or not is_deterministic(params):
        return None, None, None
    key = cache.key(model, canonical)
    with state.tracing.tracer.start_as_current_span("cache lookup") as span:
        if "no-cache" in request.headers.get("cache-control", "").lower():
            span.set_attribute("rebar.cache.result", "bypass")
            return None, Lead(cache, key, locked=False, future=None), "MISS"
        value, lead = await cache.lookup(key)
        span.set_attribute("rebar.cache.result", "hit" if value is not None else "miss")
    return value, lead, "HIT" if value is not None else "MISS"


async def finish_lead(lead: Lead | None, completion: Completion | None) -> None:
    """Write a finished answer through to the cache; anything else releases waiting requests."""
    if lead is None:
        return
    if completion is not None and completion.cacheable:
        await lead.fill(completion.to_json())
    else:
        await lead.abandon()
