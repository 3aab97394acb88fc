"""Response cache, embedding cache and rate limits through the HTTP API, over both store backends.

Every test runs twice: on the in-process memory store and on a real redis-server. Engine work is
measured with `core.stats().num_requests_added`, so "served from the cache" means no generation.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import numpy as np
import pytest

from live_server import chat_core, live_server
from redis_server import running_redis_server
from waiting import wait_until

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
EMBEDDINGS = "/v1/embeddings"
LLM_KEY = re.compile(r"^rebar:cache:llm:smollm2-v1:[0-9a-f]{64}$")


# --- fixtures and helpers ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def redis_server():
    yield from running_redis_server()


@pytest.fixture(params=["memory", "redis"])
def backend(request):
    """Store settings for the backend under test; for redis, an emptied server."""
    if request.param == "memory":
        return {"store.backend": "memory"}
    server = request.getfixturevalue("redis_server")
    server.cli("FLUSHALL")
    return {"store.backend": "redis", "store.url": server.url, "store.call_timeout_s": 2.0}


@contextmanager
def serving(served_models, backend: dict, **overrides):
    """(base URL, app) of a live server on the shared models with these settings (dotted keys)."""
    from rebar.config import load_settings
    from rebar.engine.async_engine import AsyncEngine
    from rebar.server.app import create_app

    base = {"engine.max_model_len": 2048, "engine.kv_cache_memory": 256 * 2**20}
    settings = load_settings(
        None, {**base, **backend, **{k.replace("__", "."): v for k, v in overrides.items()}}
    )
    served_models.engine = AsyncEngine(
        served_models.chat.engine
    )  # the app's lifespan shuts it down
    app = create_app(settings, served_models)
    with live_server(app, settings=settings) as url:
        yield url, app


def added(app) -> int:
    return chat_core(app).stats().num_requests_added


def chat(url: str, content: str, *, headers: dict | None = None, **fields) -> httpx.Response:
    body = {
        "model": "smollm2",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 6,
        "temperature": 0,
        **fields,
    }
    return httpx.post(url + CHAT, json=body, headers=headers, timeout=120)


def text_of(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


def without_ids(body: dict) -> dict:
    body = {k: v for k, v in body.items() if k not in ("id", "created")}
    body["usage"] = {k: v for k, v in body["usage"].items() if k != "prompt_tokens_details"}
    return body


def sse_payloads(response: httpx.Response) -> list:
    assert response.headers["content-type"].startswith("text/event-stream")
    return [
        line[len("data: ") :] for line in response.text.split("\n\n") if line.startswith("data: ")
    ]


class StoreView:
    """Read the server's store from the test thread: raw redis for redis, the MemoryStore's dict
    otherwise."""

    def __init__(self, app, backend: dict) -> None:
        self.inner = app.state.rebar.store.inner
        self.redis = None
        if backend["store.backend"] == "redis":
            import redis

            self.redis = redis.Redis.from_url(backend["store.url"])

    def keys(self, prefix: str) -> list[str]:
        if self.redis is not None:
            return sorted(k.decode() for k in self.redis.scan_iter(match=prefix + "*"))
        now = time.monotonic()
        return sorted(
            k
            for k, (_, exp) in list(self.inner._entries.items())
            if k.startswith(prefix) and (exp is None or exp > now)
        )

    def get(self, key: str) -> bytes | None:
        if self.redis is not None:
            return self.redis.get(key)
        entry = self.inner._entries.get(key)
        return (
            None
            if entry is None or (entry[1] is not None and entry[1] <= time.monotonic())
            else entry[0]
        )

    def pttl(self, key: str) -> int | None:
        if self.redis is not None:
            ttl = self.redis.pttl(key)
            return None if ttl == -2 else ttl
        return asyncio.run(self.inner.ttl_ms(key))


# --- 1. what is cached, and how hits are served -------------------------------------------------


def test_deterministic_requests_are_cached_and_random_ones_are_not(served_models, backend) -> None:
    with serving(served_models, backend) as (url, app):
        before = added(app)
        first = chat(url, "Name a colour.")
        assert first.status_code == 200 and first.headers["x-cache"] == "MISS"
        assert added(app) == before + 1

        second = chat(url, "Name a colour.")
        assert second.headers["x-cache"] == "HIT" and added(app) == before + 1
        assert without_ids(second.json()) == without_ids(first.json())
        assert second.json()["id"] != first.json()["id"]
        usage = second.json()["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"]

        refreshed = chat(url, "Name a colour.", headers={"Cache-Control": "no-cache"})
        assert refreshed.headers["x-cache"] == "MISS" and added(app) == before + 2
        assert text_of(refreshed) == text_of(first)

        # A different output-changing field is a different entry.
        assert chat(url, "Name a colour.", max_tokens=5).headers["x-cache"] == "MISS"
        assert added(app) == before + 3

        # Random sampling without a seed: never read from nor written to the cache.
        for _ in range(2):
            random = chat(url, "Name a colour.", temperature=1.0)
            assert random.status_code == 200 and random.headers.get("x-cache") != "HIT"
        assert added(app) == before + 5

        # With a seed the answer is reproducible, so it is cached.
        seeded = chat(url, "Name an animal.", temperature=1.0, seed=1234)
        assert seeded.headers["x-cache"] == "MISS"
        seeded_again = chat(url, "Name an animal.", temperature=1.0, seed=1234)
        assert seeded_again.headers["x-cache"] == "HIT" and text_of(seeded_again) == text_of(seeded)
        assert added(app) == before + 6

        # A streamed request after an identical non-streamed one replays the cached answer as SSE.
        stream = chat(url, "Name a colour.", stream=True, stream_options={"include_usage": True})
        assert stream.status_code == 200 and stream.headers["x-cache"] == "HIT"
        payloads = sse_payloads(stream)
        assert payloads[-1] == "[DONE]"
        chunks = [json.loads(p) for p in payloads[:-1]]
        content = "".join(
            c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]
        )
        assert content == text_of(first)
        assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][
            -1
        ] == first.json()["choices"][0]["finish_reason"]
        assert (
            chunks[-1]["usage"]["completion_tokens"] == first.json()["usage"]["completion_tokens"]
        )
        assert added(app) == before + 6

        # /v1/completions shares the mechanism, under its own keys.
        body = {"model": "smollm2", "prompt": "The sky is", "max_tokens": 4, "temperature": 0}
        miss = httpx.post(url + COMPLETIONS, json=body, timeout=60)
        hit = httpx.post(url + COMPLETIONS, json=body, timeout=60)
        assert (miss.headers["x-cache"], hit.headers["x-cache"]) == ("MISS", "HIT")
        assert hit.json()["choices"] == miss.json()["choices"]
        assert added(app) == before + 7


# --- 2. stampede protection ---------------------------------------------------------------------


def test_identical_concurrent_requests_generate_once(served_models, backend) -> None:
    with serving(served_models, backend) as (url, app):
        before = added(app)
        barrier = threading.Barrier(20)
        body = {
            "model": "smollm2",
            "messages": [{"role": "user", "content": "Tell me a story."}],
            "max_tokens": 24,
            "ignore_eos": True,
            "temperature": 0,
        }

        def one(_: int) -> httpx.Response:
            with httpx.Client(timeout=120) as client:
                barrier.wait()
                return client.post(url + CHAT, json=body)

        with ThreadPoolExecutor(20) as pool:
            responses = list(pool.map(one, range(20)))
        assert [r.status_code for r in responses] == [200] * 20
        assert added(app) - before == 1
        assert len({text_of(r) for r in responses}) == 1
        assert sorted(r.headers["x-cache"] for r in responses).count("MISS") == 1


# --- 3. unfinished answers are never cached -----------------------------------------------------


def test_aborted_stream_is_not_cached(served_models, backend) -> None:
    # A lock timeout longer than the client waits: a request held up until it expired would
    # fail on the client's timeout, so no clock is needed to tell.
    with serving(served_models, backend, cache__lock_timeout_s=600.0) as (url, app):
        view = StoreView(app, backend)
        cache = app.state.rebar.response_cache
        body = {
            "model": "smollm2",
            "messages": [{"role": "user", "content": "Write a long poem."}],
            "max_tokens": 48,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
        }
        before = added(app)
        with httpx.stream("POST", url + CHAT, json=body, timeout=60) as response:
            assert response.headers["x-cache"] == "MISS"
            data = (line for line in response.iter_lines() if line.startswith("data: "))
            next(data), next(data)  # the role chunk, then the first content
        core = chat_core(app)
        assert wait_until(lambda: not core.has_unfinished_requests())
        # Neither an entry nor a leftover lock, and no identical request is left waiting on the
        # aborted one.
        assert wait_until(lambda: view.keys("rebar:cache:llm:") == [] and not cache._local), (
            view.keys("rebar:cache:llm:"),
            cache._local,
        )

        again = httpx.post(url + CHAT, json=body, timeout=120)
        assert again.status_code == 200 and again.headers["x-cache"] == "MISS"
        payloads = sse_payloads(again)
        assert payloads[-1] == "[DONE]"
        finish = [json.loads(p)["choices"][0]["finish_reason"] for p in payloads[:-1]]
        assert finish[-1] == "length"
        assert added(app) == before + 2
        assert wait_until(
            lambda: len([k for k in view.keys("rebar:cache:llm:") if LLM_KEY.match(k)]) == 1
        )
        # The finished stream was written through: the non-streamed twin is a hit.
        assert (
            httpx.post(url + CHAT, json={**body, "stream": False}, timeout=60).headers["x-cache"]
            == "HIT"
        )
        assert added(app) == before + 2


# --- 4. the embedding cache, per text -----------------------------------------------------------


def test_embedding_cache_computes_only_missing_texts(served_models, backend, monkeypatch) -> None:
    with serving(served_models, backend) as (url, _app):
        embedding = served_models.embedding.embedder
        computed: list[list[str]] = []
        real_embed = embedding.embed

        def spy(texts, *args, **kwargs):
            computed.append(list(texts))
            return real_embed(texts, *args, **kwargs)

        monkeypatch.setattr(embedding, "embed", spy)

        def embed(texts: list[str]) -> httpx.Response:
            response = httpx.post(
                url + EMBEDDINGS, json={"model": "minilm", "input": texts}, timeout=60
            )
            assert response.status_code == 200, response.text
            return response

        first = embed(["a", "b"])
        assert first.headers["x-cache"] == "MISS" and computed == [["a", "b"]]
        second = embed(["a", "b"])
        assert second.headers["x-cache"] == "HIT" and computed == [["a", "b"]]
        vectors = [np.array(d["embedding"]) for d in first.json()["data"]]
        for cached, fresh in zip(second.json()["data"], vectors):
            assert np.array_equal(np.array(cached["embedding"]), fresh)
        assert second.json()["usage"] == first.json()["usage"]

        third = embed(["a", "c", "c"])
        assert third.headers["x-cache"] == "MISS" and computed == [["a", "b"], ["c"]]
        data = third.json()["data"]
        assert np.array_equal(np.array(data[0]["embedding"]), vectors[0])
        assert data[1]["embedding"] == data[2]["embedding"]
        assert not np.allclose(np.array(data[1]["embedding"]), vectors[1])


# --- 5. keys, TTLs and values in the store ------------------------------------------------------


def since_ms(started: float) -> float:
    """Milliseconds since `started` (time.time()), plus a millisecond for the store's rounding."""
    return (time.time() - started) * 1000 + 1


def test_cache_entries_have_the_documented_keys_ttls_and_values(served_models, backend) -> None:
    with serving(
        served_models, backend, cache__ttl_s=20.0, cache__stale_s=10.0, cache__embedding_ttl_s=40.0
    ) as (url, app):
        view = StoreView(app, backend)
        start = time.time()
        answer = chat(url, "Say hi.")
        assert answer.headers["x-cache"] == "MISS"

        keys = view.keys("rebar:cache:llm:")
        assert len(keys) == 1 and LLM_KEY.match(keys[0]), keys
        ttl = view.pttl(keys[0])
        # ttl + stale, less at most the time since the request started (measured, not assumed)
        assert 30_000 - since_ms(start) <= ttl <= 30_000, ttl
        entry = json.loads(view.get(keys[0]))
        assert set(entry) == {"fresh_until", "value"}
        assert start + 20 - 1 < entry["fresh_until"] <= time.time() + 20
        assert entry["value"]["choices"][0]["text"] == text_of(answer)
        assert entry["value"]["choices"][0]["finish_reason"] in ("stop", "length")
        assert entry["value"]["usage"] == [
            answer.json()["usage"]["prompt_tokens"],
            answer.json()["usage"]["completion_tokens"],
        ]
        assert not [
            k for k in view.keys("rebar:cache:llm:") if k.endswith(":lock")
        ]  # the lock was released

        vectors = httpx.post(
            url + EMBEDDINGS, json={"model": "minilm", "input": ["hello world"]}, timeout=60
        ).json()["data"]
        key = "rebar:cache:emb:minilm-v1:" + hashlib.sha256(b"hello world").hexdigest()
        assert view.keys("rebar:cache:emb:") == [key]
        assert 40_000 - since_ms(start) <= view.pttl(key) <= 40_000
        stored = np.frombuffer(view.get(key), dtype=np.float32)
        assert np.array_equal(stored, np.array(vectors[0]["embedding"], dtype=np.float32))


# --- 6. logical expiry: stale-while-revalidate --------------------------------------------------


def test_stale_entry_is_served_while_exactly_one_request_refreshes_it(
    served_models, backend
) -> None:
    with serving(served_models, backend, cache__ttl_s=1.0, cache__stale_s=30.0) as (url, app):
        view = StoreView(app, backend)
        first = chat(url, "Name a fruit.", max_tokens=16, ignore_eos=True)
        assert first.headers["x-cache"] == "MISS"
        key = view.keys("rebar:cache:llm:")[0]
        fresh_until = json.loads(view.get(key))["fresh_until"]
        while time.time() < fresh_until + 0.1:
            time.sleep(0.05)

        before = added(app)
        barrier = threading.Barrier(5)

        def one(_: int) -> httpx.Response:
            with httpx.Client(timeout=120) as client:
                barrier.wait()
                return client.post(
                    url + CHAT,
                    json={
                        "model": "smollm2",
                        "messages": [{"role": "user", "content": "Name a fruit."}],
                        "max_tokens": 16,
                        "ignore_eos": True,
                        "temperature": 0,
                    },
                )

        with ThreadPoolExecutor(5) as pool:
            responses = list(pool.map(one, range(5)))
        assert {text_of(r) for r in responses} == {text_of(first)}
        assert added(app) - before == 1
        assert sorted(r.headers["x-cache"] for r in responses) == ["HIT"] * 4 + ["MISS"]
        assert (
            json.loads(view.get(key))["fresh_until"] > fresh_until + 1.0
        )  # rewritten by the refresh


# --- 7. rate limits -----------------------------------------------------------------------------


def assert_rate_limited(response: httpx.Response, kind: str, limit: int) -> None:
    assert response.status_code == 429, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (
        error["type"] == "rate_limit_error"
        and error["code"] == "rate_limit_exceeded"
        and kind in error["message"]
    )
    assert 1 <= int(response.headers["retry-after"]) <= 60
    assert response.headers[f"x-ratelimit-limit-{kind}"] == str(limit)
    assert response.headers[f"x-ratelimit-remaining-{kind}"] == "0"


def test_requests_per_minute(served_models, backend) -> None:
    with serving(served_models, backend, rate_limits__requests_per_minute=3) as (url, app):
        remaining = [chat(url, "Hi.", max_tokens=2) for _ in range(3)]
        assert [r.status_code for r in remaining] == [200] * 3
        assert [r.headers["x-ratelimit-remaining-requests"] for r in remaining] == ["2", "1", "0"]
        assert all(r.headers["x-ratelimit-limit-requests"] == "3" for r in remaining)
        assert all(
            re.fullmatch(
                r"\d+(\.\d+)?m?s|\d+m\d+(\.\d+)?s", r.headers["x-ratelimit-reset-requests"]
            )
            for r in remaining
        )
        assert "x-ratelimit-limit-tokens" not in remaining[0].headers
        before = added(app)
        denied = chat(url, "Something new.", max_tokens=2)
        assert_rate_limited(denied, "requests", 3)
        assert added(app) == before  # nothing was generated for it
        assert_rate_limited(
            httpx.post(url + EMBEDDINGS, json={"model": "minilm", "input": "x"}, timeout=30),
            "requests",
            3,
        )
        assert app.state.rebar.gate.num_rate_limited == 2


def test_tokens_per_minute_counts_prompt_and_completion_tokens(served_models, backend) -> None:
    limit = 60
    with serving(served_models, backend, rate_limits__tokens_per_minute=limit) as (url, _app):
        used = 0
        for i in range(20):
            body = {
                "model": "smollm2",
                "prompt": f"Count {i}:",
                "max_tokens": 8,
                "ignore_eos": True,
                "temperature": 0,
            }
            response = httpx.post(url + COMPLETIONS, json=body, timeout=60)
            if response.status_code == 429:
                break
            usage = response.json()["usage"]
            assert response.headers["x-ratelimit-limit-tokens"] == str(limit)
            assert (
                int(response.headers["x-ratelimit-remaining-tokens"])
                == limit - used - usage["prompt_tokens"]
            )
            used += usage["prompt_tokens"] + usage["completion_tokens"]
        else:
            pytest.fail("the token limit never denied a request")
        assert used <= limit and i >= 2
        assert_rate_limited(response, "tokens", limit)


def test_api_keys_have_separate_limits_and_per_key_overrides(served_models, backend) -> None:
    from rebar.config import hash_api_key

    overrides = {
        "server__api_keys": ["key-a", "key-b", "key-c"],
        "rate_limits__requests_per_minute": 2,
        "rate_limits__per_key": {hash_api_key("key-c"): {"requests_per_minute": 4}},
    }
    with serving(served_models, backend, **overrides) as (url, _app):

        def statuses(key: str, count: int) -> list[int]:
            return [
                chat(
                    url, "Hi.", max_tokens=2, headers={"Authorization": f"Bearer {key}"}
                ).status_code
                for _ in range(count)
            ]

        assert statuses("key-a", 3) == [200, 200, 429]
        assert statuses("key-b", 3) == [200, 200, 429]
        assert statuses("key-c", 5) == [200, 200, 200, 200, 429]
        denied = chat(url, "Hi.", max_tokens=2, headers={"Authorization": "Bearer key-c"})
        assert_rate_limited(denied, "requests", 4)
        assert (
            chat(url, "Hi.", max_tokens=2, headers={"Authorization": "Bearer wrong"}).status_code
            == 401
        )


# --- limits a client cannot escape, caches a tenant cannot read ----------------------------------


def test_tokens_per_minute_stops_a_generation_that_runs_out(served_models, backend) -> None:
    limit = 60
    with serving(served_models, backend, rate_limits__tokens_per_minute=limit) as (url, app):
        body = {
            "model": "smollm2",
            "prompt": "Tell me a story:",
            "max_tokens": 250,
            "ignore_eos": True,
            "temperature": 0,
        }
        response = httpx.post(url + COMPLETIONS, json=body, timeout=120)
        assert response.status_code == 200, response.text
        usage = response.json()["usage"]
        assert usage["prompt_tokens"] + usage["completion_tokens"] <= limit
        assert response.json()["choices"][0]["finish_reason"] == "length"
        assert (
            StoreView(app, backend).keys("rebar:cache:llm:") == []
        )  # a cut answer is never cached
        assert_rate_limited(httpx.post(url + COMPLETIONS, json=body, timeout=60), "tokens", limit)
        wait_until(lambda: chat_core(app).stats().num_running == 0)
        assert chat_core(app).stats().num_running == 0  # the cut request was stopped


def test_tokens_per_minute_holds_across_concurrent_streams(served_models, backend) -> None:
    limit = 90
    with serving(served_models, backend, rate_limits__tokens_per_minute=limit) as (url, _app):

        def stream(i: int) -> int:
            body = {
                "model": "smollm2",
                "prompt": f"Story {i}:",
                "max_tokens": 100,
                "ignore_eos": True,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            response = httpx.post(url + COMPLETIONS, json=body, timeout=120)
            if response.status_code == 429:
                return 0
            usage = json.loads(sse_payloads(response)[-2])["usage"]
            return usage["prompt_tokens"] + usage["completion_tokens"]

        with ThreadPoolExecutor(3) as pool:
            spent = list(pool.map(stream, range(3)))
        assert 0 < sum(spent) <= limit, spent


def test_a_made_up_bearer_or_forwarded_for_is_not_a_new_client(served_models, backend) -> None:
    with serving(served_models, backend, rate_limits__requests_per_minute=2) as (url, _app):
        statuses = [
            chat(
                url,
                "Hi.",
                max_tokens=2,
                headers={"Authorization": f"Bearer random-{i}", "X-Forwarded-For": f"10.0.0.{i}"},
            ).status_code
            for i in range(4)
        ]
        assert statuses == [200, 200, 429, 429]


def test_tenants_do_not_share_cached_answers_or_prefix_blocks(served_models, backend) -> None:
    with serving(served_models, backend, server__api_keys=["tenant-a", "tenant-b"]) as (url, _app):
        a, b = ({"Authorization": f"Bearer {key}"} for key in ("tenant-a", "tenant-b"))
        # Unique per run: the engine (and its prefix cache) outlives each test's server.
        secret = (
            f"My account number is {uuid.uuid4()} and my password is hunter2; summarise my situation. "
            * 3
        )

        def cached_tokens(response: httpx.Response) -> int:
            return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

        first = chat(url, secret, headers=a)
        assert first.status_code == 200 and first.headers["x-cache"] == "MISS"
        chat(
            url, secret.replace("password", "passcode"), headers=b
        )  # b's own template blocks are now cached
        guess = chat(url, secret, headers=b)
        assert guess.headers["x-cache"] == "MISS"  # b cannot see a's answer...
        control = chat(url, secret.replace("password", "pin"), headers=b)  # a prompt nobody sent
        assert cached_tokens(guess) == cached_tokens(
            control
        )  # ...nor tell a's prompt blocks from no blocks
        assert chat(url, secret, headers=a).headers["x-cache"] == "HIT"
        uncached = chat(url, secret, headers={**a, "cache-control": "no-cache"})
        assert cached_tokens(uncached) > cached_tokens(guess) + 32  # a still shares with itself
        assert text_of(guess) == text_of(first)


def test_tenant_isolation_off_shares_caches_between_keys(served_models, backend) -> None:
    overrides = {"server__api_keys": ["tenant-a", "tenant-b"], "cache__tenant_isolation": "off"}
    with serving(served_models, backend, **overrides) as (url, _app):
        prompt = (
            f"A prompt long enough to fill a couple of KV blocks of sixteen tokens each: {uuid.uuid4()}. "
            * 2
        )
        assert (
            chat(url, prompt, headers={"Authorization": "Bearer tenant-a"}).headers["x-cache"]
            == "MISS"
        )
        assert (
            chat(url, prompt, headers={"Authorization": "Bearer tenant-b"}).headers["x-cache"]
            == "HIT"
        )


def test_forwarded_for_is_believed_from_a_trusted_proxy(served_models, backend) -> None:
    overrides = {"rate_limits__requests_per_minute": 1, "server__trusted_proxies": ["127.0.0.1"]}
    with serving(served_models, backend, **overrides) as (url, _app):

        def status(forwarded_for: str) -> int:
            return chat(
                url, "Hi.", max_tokens=2, headers={"X-Forwarded-For": forwarded_for}
            ).status_code

        # Behind a trusted proxy each forwarded address is its own client.
        assert [status("10.1.0.1"), status("10.1.0.2"), status("10.1.0.1")] == [200, 200, 429]
