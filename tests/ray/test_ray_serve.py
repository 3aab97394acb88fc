"""rebar on Ray Serve, on a local Ray cluster started here: two SmolLM2 replicas behind Ray
Serve's proxy sharing a real Redis. Both take traffic; streams, errors and headers are rebar's;
a disconnect aborts the generation; a rate limit holds once across replicas; a reload reaches
every replica; killing a replica mid-load fails no non-streaming request and Ray replaces it."""

from __future__ import annotations

import hashlib
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import httpx
import pytest

from live_server import free_port
from markers import requires_smollm2
from redis_server import running_redis_server
from suite_tiers import limit

pytestmark = [requires_smollm2, limit("cluster")]

USER, LIMITED, ADMIN = "user-key-1", "limited-key-2", "admin-key-3"
MiB = 2**20


@pytest.fixture(scope="module")
def cluster():
    """The proxy's `url`, the `redis` and the `settings` of a two-replica deployment; Ray and
    Redis stop afterwards."""
    import ray
    from ray import serve
    from rebar.config import load_settings
    from rebar.ray_serve import APP_NAME, application

    for redis in running_redis_server():
        settings = load_settings(
            None,
            {
                "models.embedding": "",
                "engine.max_model_len": 512,
                "engine.kv_cache_memory": 32 * MiB,
                "engine.num_threads": 1,
                "store.backend": "redis",
                "store.url": redis.url,
                "server.api_keys": [USER, LIMITED],
                "server.admin_api_keys": [ADMIN],
                "rate_limits.per_key": {
                    hashlib.sha256(LIMITED.encode()).hexdigest(): {"requests_per_minute": 5}
                },
                "cache.enabled": False,
                "ray.num_replicas": 2,
                "ray.num_cpus": 0.5,
                "server.drain_timeout_s": 10,
            },
        )
        port = free_port()
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            serve.run(application(settings), name=APP_NAME, route_prefix="/")
            yield SimpleNamespace(url=f"http://127.0.0.1:{port}", redis=redis, settings=settings)
        finally:
            serve.shutdown()
            ray.shutdown()


def auth(key: str = USER) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def complete(url: str, prompt: str, key: str = USER, max_tokens: int = 8) -> httpx.Response:
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.7}
    return httpx.post(url + "/v1/completions", json=body, headers=auth(key), timeout=120)


def test_two_replicas_take_32_concurrent_requests(cluster) -> None:
    url = cluster.url
    with ThreadPoolExecutor(32) as pool:
        replies = list(pool.map(lambda i: complete(url, f"Request {i}: hello"), range(32)))
    assert [r.status_code for r in replies] == [200] * 32, [r.text for r in replies]
    replicas = {r.headers["x-rebar-replica"] for r in replies}
    assert len(replicas) == 2, replicas


def test_streams_errors_and_headers_are_rebars(cluster) -> None:
    url = cluster.url
    body = {
        "model": "smollm2",
        "messages": [{"role": "user", "content": "Say hi"}],
        "max_tokens": 8,
        "stream": True,
    }
    headers = {**auth(), "X-Request-ID": "client-id-42"}
    with httpx.stream(
        "POST", url + "/v1/chat/completions", json=body, headers=headers, timeout=120
    ) as reply:
        lines = [line for line in reply.iter_lines() if line]
    assert reply.status_code == 200
    assert reply.headers["content-type"].startswith("text/event-stream")
    assert reply.headers.get_list("x-request-id") == ["client-id-42"]
    assert reply.headers["x-rebar-model-version"].startswith("smollm2-v")
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert {c["system_fingerprint"] for c in chunks} == {reply.headers["x-rebar-model-version"]}

    bad = httpx.post(url + "/v1/chat/completions", json={"model": "smollm2"}, headers=auth())
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages"
    missing = httpx.post(
        url + "/v1/completions", json={"model": "nope", "prompt": "hi"}, headers=auth()
    )
    assert missing.status_code == 400
    assert missing.json()["error"]["code"] == "model_not_found"
    unauthorized = httpx.post(url + "/v1/completions", json={"model": "smollm2", "prompt": "x"})
    assert unauthorized.status_code == 401
    assert unauthorized.json()["error"]["type"] == "authentication_error"
    assert len(reply.headers.get_list("x-rebar-replica")) == 1


def running_per_replica(url: str) -> dict[str, float]:
    """rebar_requests_running of each replica reached in a few /metrics scrapes."""
    from prometheus_client.parser import text_string_to_metric_families

    seen: dict[str, float] = {}
    for _ in range(12):
        reply = httpx.get(url + "/metrics", timeout=10)
        for family in text_string_to_metric_families(reply.text):
            for sample in family.samples:
                if sample.name == "rebar_requests_running":
                    seen[reply.headers["x-rebar-replica"]] = sample.value
    return seen


def test_a_client_that_leaves_mid_stream_aborts_its_generation(cluster) -> None:
    url = cluster.url
    body = {
        "model": "smollm2",
        "prompt": "Once upon a time",
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", url + "/v1/completions", json=body, headers=auth(), timeout=120) as r:
        assert r.status_code == 200
        for n, _line in enumerate(r.iter_lines()):
            if n >= 6:
                break  # leave after a few chunks: the connection closes
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        running = running_per_replica(url)
        if len(running) == 2 and not any(running.values()):
            break
        time.sleep(0.5)
    assert len(running) == 2 and not any(running.values()), running


def test_a_rate_limit_holds_once_across_replicas(cluster) -> None:
    url, redis = cluster.url, cluster.redis
    replies = [complete(url, f"Limited {i}", key=LIMITED, max_tokens=1) for i in range(10)]
    assert [r.status_code for r in replies] == [200] * 5 + [429] * 5, [r.text for r in replies]
    assert int(replies[-1].headers["retry-after"]) >= 1
    counters = [k for k in redis.cli("--scan", "--pattern", "rebar:rl:*").split() if k]
    assert counters and all(redis.cli("GET", k) == "5" for k in counters if k.endswith(":req"))


def test_a_reload_reaches_every_replica(cluster) -> None:
    url = cluster.url
    reply = httpx.post(url + "/admin/models/smollm2/reload", headers=auth(ADMIN), timeout=300)
    assert reply.status_code == 200, reply.text
    version = f"smollm2-v{reply.json()['version']}"
    assert reply.json()["processes_reached"] == 1  # the other replica
    deadline = time.monotonic() + 120
    on_new: set[str] = set()
    while len(on_new) < 2 and time.monotonic() < deadline:
        answer = complete(url, "Which version?", max_tokens=2)
        assert answer.status_code == 200
        if answer.headers["x-rebar-model-version"] == version:
            on_new.add(answer.headers["x-rebar-replica"])
    assert len(on_new) == 2, on_new


def test_killing_a_replica_mid_load_fails_no_request_and_ray_replaces_it(cluster) -> None:
    """Ray's proxy answers 500 for the requests that were running on the killed replica (it does
    not resend a request a replica had taken); the stock OpenAI client retries those, as it does
    any 5xx, so none of its requests fails."""
    import openai

    import ray

    url = cluster.url
    client = openai.OpenAI(base_url=url + "/v1", api_key=USER, max_retries=2, timeout=120)
    stop = threading.Event()
    answered: list[str] = []
    failures: list[str] = []

    def user(i: int) -> None:
        n = 0
        while not stop.is_set():
            n += 1
            try:
                reply = client.completions.create(
                    model="smollm2", prompt=f"Client {i} request {n}", max_tokens=16
                )
                answered.append(reply.choices[0].text)
            except openai.OpenAIError as exc:
                failures.append(repr(exc))

    replicas = [
        actor["name"]
        for actor in ray.util.list_named_actors(all_namespaces=True)
        if actor["namespace"] == "serve" and "RebarReplica" in actor["name"]
    ]
    assert len(replicas) == 2, replicas
    with ThreadPoolExecutor(8) as pool:
        for i in range(8):
            pool.submit(user, i)
        time.sleep(3)
        ray.kill(ray.get_actor(replicas[0], namespace="serve"), no_restart=True)
        time.sleep(6)  # the load goes on past the kill: its retries land on the other replica
        stop.set()
    assert failures == [], failures[:5]
    assert len(answered) > 20
    deadline = time.monotonic() + 120
    seen: set[str] = set()
    while time.monotonic() < deadline and len(seen) < 2:
        seen.add(complete(url, "After the kill", max_tokens=1).headers["x-rebar-replica"])
    assert len(seen) == 2 and replicas[0].split("#")[-1] not in seen, (replicas, seen)


def test_scaling_down_drains_the_streams_of_the_replica_it_stops(cluster) -> None:
    """A replica Ray stops (here: the deployment scaled to one) finishes its streams first."""
    from ray import serve
    from rebar.ray_serve import APP_NAME, application

    url = cluster.url
    body = {
        "model": "smollm2",
        "prompt": "A long story:",
        "max_tokens": 120,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    results: list[tuple[int, str, int]] = []
    replicas: set[str] = set()

    def stream(i: int) -> None:
        with httpx.stream(
            "POST", url + "/v1/completions", json=body, headers=auth(), timeout=300
        ) as reply:
            lines = [line for line in reply.iter_lines() if line.startswith("data: ")]
        replicas.add(reply.headers["x-rebar-replica"])
        usage = json.loads(lines[-2][6:])["usage"] if len(lines) > 1 else {}
        results.append(
            (reply.status_code, lines[-1] if lines else "", usage.get("completion_tokens", 0))
        )

    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(stream, i) for i in range(6)]
        time.sleep(2)
        settings = cluster.settings
        fewer = settings.model_copy(
            update={"ray": settings.ray.model_copy(update={"num_replicas": 1})}
        )
        serve.run(application(fewer), name=APP_NAME, route_prefix="/")
        for future in futures:
            future.result(300)
    assert [(code, last) for code, last, _ in results] == [(200, "data: [DONE]")] * 6
    assert [tokens for _, _, tokens in results] == [120] * 6  # every token arrived
    assert len(replicas) == 2  # so the stopped replica had streams in flight
