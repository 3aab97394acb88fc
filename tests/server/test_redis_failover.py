"""Redis as the shared store of real servers: limits shared across processes, and a Redis crash
under load that costs no request (the server falls back, then picks Redis up again)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

import httpx
import pytest

from live_server import free_port, live_server
from markers import requires_smollm2
from redis_server import running_redis_server
from suite_tiers import limit

pytestmark = limit("processes")  # tests/suite_tiers.py

CHAT = "/v1/chat/completions"


@pytest.fixture
def redis_server():
    """A redis-server of this test's own: the tests kill it."""
    yield from running_redis_server()


def start_serve(log_path: Path, env: dict) -> tuple[subprocess.Popen, str]:
    port = free_port()
    full_env = {
        **os.environ,
        "REBAR_ENGINE__MAX_MODEL_LEN": "512",
        "REBAR_ENGINE__KV_CACHE_MEMORY": str(64 * 2**20),
        "REBAR_ENGINE__NUM_THREADS": "1",
        **env,
    }
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "rebar.cli",
                "serve",
                "--port",
                str(port),
                "--embedding-model",
                "none",
            ],
            env=full_env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    return process, f"http://127.0.0.1:{port}"


def wait_ready(process: subprocess.Popen, url: str, log_path: Path, timeout: float = 120) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if process.poll() is not None:
            raise AssertionError(
                f"rebar serve exited with {process.returncode}:\n{log_path.read_text()}"
            )
        try:
            if httpx.get(url + "/ready", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"rebar serve was not ready in {timeout}s:\n{log_path.read_text()}")


@requires_smollm2
def test_two_processes_share_one_rate_limit(redis_server, tmp_path) -> None:
    env = {
        "REBAR_STORE__BACKEND": "redis",
        "REBAR_STORE__URL": redis_server.url,
        "REBAR_RATE_LIMITS__REQUESTS_PER_MINUTE": "5",
    }
    servers = [start_serve(tmp_path / f"server{i}.log", env) for i in range(2)]
    try:
        for i, (process, url) in enumerate(servers):
            wait_ready(process, url, tmp_path / f"server{i}.log")
        body = {"model": "smollm2", "prompt": "Hello", "max_tokens": 1, "temperature": 0}
        responses = [
            httpx.post(servers[i % 2][1] + "/v1/completions", json=body, timeout=60)
            for i in range(10)
        ]
        assert [r.status_code for r in responses] == [200] * 5 + [429] * 5, [
            r.text for r in responses
        ]
        # Both processes answered, and both counted against the one shared limit.
        assert [r.headers["x-ratelimit-remaining-requests"] for r in responses[:5]] == [
            "4",
            "3",
            "2",
            "1",
            "0",
        ]
        assert {r.headers["x-ratelimit-limit-requests"] for r in responses} == {"5"}
        assert all(
            r.json()["error"]["code"] == "rate_limit_exceeded"
            and int(r.headers["retry-after"]) >= 1
            for r in responses[5:]
        )
        assert redis_server.cli("GET", "rebar:rl:addr-127.0.0.1:req") == "5"
    finally:
        for process, _ in servers:
            process.terminate()
        for process, _ in servers:
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()


def test_redis_crash_under_load_costs_no_request_and_the_cache_comes_back(
    served_models, redis_server
) -> None:
    from rebar.config import load_settings
    from rebar.engine.async_engine import AsyncEngine
    from rebar.server.app import create_app

    settings = load_settings(
        None,
        {
            "engine.max_model_len": 2048,
            "engine.kv_cache_memory": 256 * 2**20,
            "store.backend": "redis",
            "store.url": redis_server.url,
            "store.open_for_s": 0.5,
            "store.on_store_error": "allow",
            "rate_limits.requests_per_minute": 10_000,
        },
    )
    served_models.engine = AsyncEngine(
        served_models.chat.engine
    )  # the app's lifespan shuts it down
    app = create_app(settings, served_models)
    store = app.state.rebar.store
    prompts = ["Name a colour.", "Name a fruit.", "Name a city.", "Name a river."]

    def body(i: int) -> dict:
        if i % 2:  # random sampling: never cached
            return {
                "model": "smollm2",
                "messages": [{"role": "user", "content": f"Say something #{i}."}],
                "max_tokens": 3,
                "temperature": 1.0,
            }
        return {
            "model": "smollm2",
            "messages": [{"role": "user", "content": prompts[i // 2 % 4]}],
            "max_tokens": 3,
            "temperature": 0,
        }

    with live_server(app) as url:
        done = threading.Semaphore(0)
        with httpx.Client(timeout=60, limits=httpx.Limits(max_connections=8)) as client:

            def one(i: int) -> httpx.Response:
                try:
                    return client.post(url + CHAT, json=body(i))
                finally:
                    done.release()

            with ThreadPoolExecutor(8) as pool:
                futures = [pool.submit(one, i) for i in range(50)]
                for _ in range(12):
                    done.acquire()
                redis_server.kill()
                answered_before_kill = sum(f.done() for f in futures)
                responses = [f.result() for f in as_completed(futures)]

        assert [r.status_code for r in responses if r.status_code != 200] == [], [
            r.text for r in responses if r.status_code != 200
        ]
        assert answered_before_kill <= 40  # most of the load ran while Redis was gone
        assert (
            store.num_errors > 0 and store.circuit_open
        )  # the outage was noticed and the circuit opened
        assert {r.headers["x-cache"] for r in responses if "x-cache" in r.headers} >= {
            "MISS",
            "HIT",
        }

        redis_server.start()  # same port, empty
        time.sleep(settings.store.open_for_s + 0.1)
        deadline = time.monotonic() + 15
        attempt = 0
        while True:
            attempt += 1
            messages = [
                {"role": "user", "content": f"Name a number after the restart, try {attempt}."}
            ]
            request = {"model": "smollm2", "messages": messages, "max_tokens": 3, "temperature": 0}
            first = httpx.post(url + CHAT, json=request, timeout=60)
            second = httpx.post(url + CHAT, json=request, timeout=60)
            assert first.status_code == second.status_code == 200
            if second.headers["x-cache"] == "HIT":
                break
            assert time.monotonic() < deadline, "cache hits never resumed after Redis came back"
            time.sleep(0.2)
        assert second.json()["choices"] == first.json()["choices"]
        assert not store.circuit_open
        keys = redis_server.cli("--scan", "--pattern", "rebar:cache:llm:smollm2-v1:*").split()
        assert len(keys) >= 1 and not any(k.endswith(":lock") for k in keys)
        # The rate limiter counts in Redis again (its fallback reports the whole limit as
        # remaining).
        assert int(second.headers["x-ratelimit-remaining-requests"]) < 10_000
        assert redis_server.cli("GET", "rebar:rl:addr-127.0.0.1:req") not in ("", "0")
