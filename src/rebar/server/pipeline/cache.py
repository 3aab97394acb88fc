"""The cache stage: response and embedding caches on a Store, with stampede protection and logical
expiry.

Only deterministic requests (greedy, or seeded) are cached, keyed by the model version (and the
tenant, when caches are isolated) and every field that changes the output.

A cached completion stays *fresh* for `ttl_s`, then *stale* for `stale_s` more: a stale entry is
served while exactly one request (the one that takes the lock) regenerates it. Identical requests
that miss at the same time wait for the first one's result instead of generating it again: on one
process through an in-process future, across processes through a `SET NX PX` lock and polling.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from starlette.requests import Request

from rebar.engine.sampling_params import SamplingParams
from rebar.obs.tracing import Tracing
from rebar.server.pipeline.call import Call, Live, Next, Outcome
from rebar.server.pipeline.results import Completion
from rebar.store.base import Store

POLL_INTERVAL_S = 0.05


def digest(data: Any) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


@dataclass
class Lead:
    """Held by the one request that generates a missing entry; it must call `fill` or `abandon`."""

    cache: ResponseCache
    key: str
    locked: bool
    future: asyncio.Future | None
    done: bool = False

    async def fill(self, value: dict) -> None:
        if self.done:
            return
        self.done = True
        try:
            await self.cache._write(self.key, value)
        finally:
            await self._release(value)

    async def abandon(self) -> None:
        if not self.done:
            self.done = True
            await self._release(None)

    async def _release(self, value: dict | None) -> None:
        # This often runs in the cleanup of a cancelled stream (client gone), where any await can be
        # interrupted: release the waiters before awaiting anything, and shield the lock's deletion,
        # or identical requests would stall until lock_timeout_s.
        if self.future is not None:
            self.cache._local.pop(self.key, None)
            if not self.future.done():
                self.future.set_result(value)
        if self.locked:
            await asyncio.shield(self.cache.store.delete(self.cache.lock_key(self.key)))


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    stale_hits: int = 0
    waits: int = 0
    too_large: int = 0  # answers over max_entry_bytes, not stored


@dataclass
class ResponseCache:
    store: Store
    prefix: str
    ttl_s: float
    stale_s: float
    lock_timeout_s: float
    max_entry_bytes: int = 4 * 2**20  # a bigger answer is served but not stored
    clock: Any = time.time
    stats: CacheStats = field(default_factory=CacheStats)
    _local: dict[str, asyncio.Future] = field(default_factory=dict)

    def key(self, model: str, canonical: dict) -> str:
        return f"{self.prefix}:cache:llm:{model}:{digest(canonical)}"

    def lock_key(self, key: str) -> str:
        return f"{key}:lock"

    async def lookup(self, key: str) -> tuple[dict | None, Lead | None]:
        """(value, None) for a hit; (None, lead) when the caller must generate and fill the
        entry."""
        value, fresh = await self._read(key)
        if value is not None and fresh:
            self.stats.hits += 1
            return value, None
        if value is not None:  # stale: one caller refreshes, the rest are served the stale value
            if await self._take_lock(key):
                self.stats.misses += 1
                return None, Lead(self, key, locked=True, future=None)
            self.stats.stale_hits += 1
            return value, None
        local = self._local.get(key)
        if (
            local is not None
        ):  # an identical request of this process is generating it: wait for its result
            self.stats.waits += 1
            try:
                waited = await asyncio.wait_for(asyncio.shield(local), self.lock_timeout_s)
            except TimeoutError:
                self.stats.misses += 1
                return None, Lead(
                    self, key, locked=False, future=None
                )  # too slow: generate without leading
            if waited is None:
                return await self.lookup(
                    key
                )  # the leader gave up: look again, one of the waiters leads next
            self.stats.hits += 1
            return waited, None
        # No await between the check above and this registration: identical requests arriving from
        # now on wait for this one instead of each becoming a leader while the store answers.
        future = asyncio.get_running_loop().create_future()
        self._local[key] = future
        try:
            locked = await self._take_lock(key)
            if not locked:  # another process is generating it
                waited = await self._wait_for_other_process(key)
                if waited is not None:
                    self.stats.hits += 1
                    self._local.pop(key, None)
                    future.set_result(waited)
                    return waited, None
                locked = await self._take_lock(key)
        except BaseException:
            await Lead(self, key, locked=False, future=future).abandon()
            raise
        self.stats.misses += 1
        return None, Lead(self, key, locked=locked, future=future)

    async def _take_lock(self, key: str) -> bool:
        return await self.store.set_if_absent(
            self.lock_key(key), b"1", int(self.lock_timeout_s * 1000)
        )

    async def _wait_for_other_process(self, key: str) -> dict | None:
        """Another process holds the lock: poll (bounded) for its result; None if it gave up or took
        too long."""
        self.stats.waits += 1
        deadline = time.monotonic() + self.lock_timeout_s
        while time.monotonic() < deadline:
            await asyncio.sleep(POLL_INTERVAL_S)
            value, _fresh = await self._read(key)
            if value is not None:
                return value
            if await self.store.get(self.lock_key(key)) is None:
                return None  # the leader gave up; generate ourselves
        return None

    async def _read(self, key: str) -> tuple[dict | None, bool]:
        raw = await self.store.get(key)
        if raw is None:
            return None, False
        try:
            entry = json.loads(raw)
            return entry["value"], self.clock() < entry["fresh_until"]
        except (ValueError, KeyError, TypeError):
            return None, False  # unreadable entry: treat as a miss and overwrite it

    async def _write(self, key: str, value: dict) -> None:
        entry = json.dumps(
            {"fresh_until": self.clock() + self.ttl_s, "value": value}, ensure_ascii=False
        ).encode()
        if len(entry) > self.max_entry_bytes:
            self.stats.too_large += 1
            return
        await self.store.set(key, entry, int((self.ttl_s + self.stale_s) * 1000))


@dataclass
class EmbeddingCache:
    store: Store
    prefix: str
    ttl_s: float
    stats: CacheStats = field(default_factory=CacheStats)

    def key(self, model: str, text: str | tuple[int, ...]) -> str:
        """A text's key is its SHA-256; token ids' that of their decimal list, under `ids:`."""
        if isinstance(text, str):
            return f"{self.prefix}:cache:emb:{model}:{hashlib.sha256(text.encode()).hexdigest()}"
        spelled = ",".join(map(str, text)).encode()
        return f"{self.prefix}:cache:emb:{model}:ids:{hashlib.sha256(spelled).hexdigest()}"

    async def get_many(
        self, model: str, texts: list[str | tuple[int, ...]]
    ) -> list[np.ndarray | None]:
        found = []
        for text in texts:
            raw = await self.store.get(self.key(model, text))
            found.append(None if raw is None else np.frombuffer(raw, dtype=np.float32).copy())
        hits = sum(v is not None for v in found)
        self.stats.hits += hits
        self.stats.misses += len(texts) - hits
        return found

    async def put_many(
        self, model: str, texts: list[str | tuple[int, ...]], vectors: list[np.ndarray]
    ) -> None:
        for text, vector in zip(texts, vectors):
            await self.store.set(
                self.key(model, text), vector.astype(np.float32).tobytes(), int(self.ttl_s * 1000)
            )


async def run(call: Call, next: Next) -> Outcome:
    """Down: a deterministic request the cache holds is answered from it, and goes no further.
    Up: a fresh answer is written through (a stream's once all its choices have finished); one
    that failed or was cut releases the requests waiting for it."""
    assert call.model is not None and call.prepared is not None and call.passed is not None
    state, admitted = call.state, call.prepared.admitted
    prompt_ids, params = list(admitted.prompt_token_ids), admitted.params
    canonical = canonical_request(call.request.endpoint, prompt_ids, params, call.passed.tenant)
    cached, lead, header = await lookup(
        state.response_cache,
        state.tracing,
        call.http,
        call.model.label,
        canonical,
        params,
        len(prompt_ids),
    )
    if cached is not None:
        outcome = Outcome(completion=cached)
    else:
        try:
            outcome = await next(call)
        except BaseException:
            await finish_lead(lead, None)
            raise
        if outcome.live is not None:
            outcome.live = _written_through(outcome.live, lead, params.n)
        else:
            await finish_lead(lead, outcome.completion)
    if header:
        outcome.headers["X-Cache"] = header
    return outcome


async def _written_through(live: Live, lead: Lead | None, n: int) -> Live:
    """`live`, its whole answer written through to the cache once all `n` choices finished."""
    whole = None
    try:
        async for item in live:
            if isinstance(item, Completion) and len(item.choices) == n:
                whole = item
            yield item
    finally:
        try:
            await live.aclose()
        finally:
            await finish_lead(lead, whole)


def canonical_request(
    endpoint: str, prompt_ids: list[int], params: SamplingParams, tenant: str | None
) -> dict:
    """The fields that change the output (not `stream`, not usage options), in a stable form."""
    fields = {f.name: getattr(params, f.name) for f in dataclasses.fields(params)}
    fields["logit_bias"] = sorted((params.logit_bias or {}).items())
    fields["stop"], fields["stop_token_ids"] = list(params.stop), list(params.stop_token_ids)
    if params.structured is not None:
        fields["structured"] = dataclasses.asdict(params.structured)
    extra = {"tenant": tenant} if tenant else {}
    return {"endpoint": endpoint, "prompt": prompt_ids, "params": fields, **extra}


def is_deterministic(params: SamplingParams) -> bool:
    return params.temperature == 0 or params.seed is not None


async def lookup(
    cache: ResponseCache | None,
    tracing: Tracing,
    request: Request,
    version: str,
    canonical: dict,
    params: SamplingParams,
    num_prompt_tokens: int,
) -> tuple[Completion | None, Lead | None, str | None]:
    """(the cached answer, the lead, the X-Cache header). No cache, a random request or
    `Cache-Control: no-cache` skip the read; a no-cache request still refreshes the entry. Keyed by
    `version`: a reloaded model never replays an older version's answers."""
    if cache is None or not is_deterministic(params):
        return None, None, None
    key = cache.key(version, canonical)
    with tracing.tracer.start_as_current_span("cache lookup") as span:
        if "no-cache" in request.headers.get("cache-control", "").lower():
            span.set_attribute("rebar.cache.result", "bypass")
            return None, Lead(cache, key, locked=False, future=None), "MISS"
        value, lead = await cache.lookup(key)
        span.set_attribute("rebar.cache.result", "hit" if value is not None else "miss")
    if value is None:
        return None, lead, "MISS"
    return Completion.from_json(value, num_prompt_tokens), lead, "HIT"


async def finish_lead(lead: Lead | None, completion: Completion | None) -> None:
    """Write a finished answer through to the cache; anything else releases waiting requests."""
    if lead is None:
        return
    if completion is not None and completion.cacheable:
        await lead.fill(completion.to_json())
    else:
        await lead.abandon()
