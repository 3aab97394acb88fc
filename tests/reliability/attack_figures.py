"""The attacks of docs/reliability.md, measured against a live server on the bundled models.

Not a test (the regression tests are tests/server/test_hostile_inputs.py and this folder's): it
prints the figures the docs quote. Run from the repository root:

    .venv/bin/python tests/reliability/attack_figures.py
"""

from __future__ import annotations

import json
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: live_server

import contextlib

from live_server import embedding_model, server_settings, serving_models, slowest_health

CHAT = "/v1/chat/completions"
ASK = [{"role": "user", "content": "What is the capital of France?"}]


def made_up_methods(url: str, count: int = 20_000) -> dict:
    before = len(httpx.get(url + "/metrics").content)
    started = time.monotonic()
    with httpx.Client() as client:
        for i in range(count):
            client.request(f"M{i}", url + f"/x/{i}")
    metrics = httpx.get(url + "/metrics")
    return {
        "requests": count,
        "seconds": round(time.monotonic() - started, 1),
        "metrics_bytes_before": before,
        "metrics_bytes_after": len(metrics.content),
    }


def slow_clients(url: str, count: int = 300) -> dict:
    host, port = url.removeprefix("http://").split(":")
    sockets = []
    for _ in range(count):
        sock = socket.create_connection((host, int(port)))
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        sockets.append(sock)
    started = time.monotonic()
    status = httpx.get(url + "/health", timeout=30).status_code
    health_s = time.monotonic() - started
    closed_at = []
    for sock in sockets:
        sock.settimeout(30)
        data = sock.recv(65536)
        closed_at.append(time.monotonic() - started)
        assert data.startswith(b"HTTP/1.1 408"), data[:40]
        sock.close()
    return {
        "connections": count,
        "health_status": status,
        "health_s": round(health_s, 3),
        "all_closed_with_408_after_s": round(max(closed_at), 1),
    }


def huge_prompt(url: str) -> dict:
    text = "lorem ipsum dolor sit amet " * 36_000
    worst, response = slowest_health(
        url, lambda: httpx.post(url + "/tokenize", json={"prompt": text}, timeout=120)
    )
    return {
        "prompt_bytes": len(text),
        "tokens": response.json()["count"],
        "worst_health_s": round(worst, 3),
    }


def abandoned_embeddings(url: str, app) -> dict:
    queue = embedding_model(app).queue

    def attack():
        with ThreadPoolExecutor(3) as pool:
            list(pool.map(lambda _: _give_up(url), range(3)))
        started = time.monotonic()
        while queue.num_waiting_inputs:
            time.sleep(0.05)
        idle_s = time.monotonic() - started
        chat_started = time.monotonic()
        httpx.post(
            url + CHAT, json={"model": "smollm2", "messages": ASK, "max_tokens": 8}, timeout=120
        )
        return idle_s, time.monotonic() - chat_started

    worst, (idle_s, chat_s) = slowest_health(url, attack)
    return {
        "requests": 3,
        "inputs_each": 2048,
        "client_timeout_s": 2,
        "queue_idle_after_leaving_s": round(idle_s, 2),
        "chat_after_s": round(chat_s, 2),
        "worst_health_s": round(worst, 3),
    }


def _give_up(url: str) -> None:
    with contextlib.suppress(httpx.TimeoutException):
        httpx.post(
            url + "/v1/embeddings",
            json={"model": "minilm", "input": [f"text {i}" for i in range(2048)]},
            timeout=2,
        )


def tokens_per_minute(served_models) -> dict:
    limit = 60
    settings = server_settings(**{"rate_limits.tokens_per_minute": limit})
    body = {
        "model": "smollm2",
        "prompt": "Tell me a story:",
        "max_tokens": 250,
        "ignore_eos": True,
        "temperature": 0,
    }
    with serving_models(served_models, settings) as (url, _):
        usage = httpx.post(url + "/v1/completions", json=body, timeout=120).json()["usage"]
        one = usage["total_tokens"]
    with serving_models(served_models, settings) as (url, _):

        def run(i: int) -> int:
            response = httpx.post(
                url + "/v1/completions", json={**body, "prompt": f"Story {i}:"}, timeout=120
            )
            return response.json()["usage"]["total_tokens"] if response.status_code == 200 else 0

        with ThreadPoolExecutor(3) as pool:
            three = sum(pool.map(run, range(3)))
    return {"limit": limit, "one_request_tokens": one, "three_concurrent_tokens": three}


def tenant_probe(served_models) -> dict:
    settings = server_settings(**{"server.api_keys": ["tenant-a", "tenant-b"]})
    secret = f"My account number is {time.time_ns()} and my password is hunter2; summarise. " * 4
    with serving_models(served_models, settings) as (url, _):

        def ask(key: str, content: str) -> httpx.Response:
            return httpx.post(
                url + CHAT,
                json={
                    "model": "smollm2",
                    "messages": [{"role": "user", "content": content}],
                    "max_tokens": 4,
                    "temperature": 0,
                },
                headers={"Authorization": f"Bearer {key}"},
                timeout=120,
            )

        ask("tenant-a", secret)
        ask("tenant-b", secret.replace("password", "pin"))  # b's own template blocks cached
        guess = ask("tenant-b", secret)
        wrong = ask("tenant-b", secret.replace("password", "code"))

        def cached(response: httpx.Response) -> int:
            return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

        return {
            "right_guess": {"x_cache": guess.headers["x-cache"], "cached_tokens": cached(guess)},
            "wrong_guess": {"x_cache": wrong.headers["x-cache"], "cached_tokens": cached(wrong)},
        }


def main() -> None:
    from rebar.server.app import load_models

    served = load_models(server_settings())
    figures: dict = {}
    with serving_models(served, server_settings()) as (url, app):
        figures["made_up_methods"] = made_up_methods(url)
        figures["huge_prompt"] = huge_prompt(url)
        figures["abandoned_embeddings"] = abandoned_embeddings(url, app)
    with serving_models(served, server_settings(**{"server.header_timeout_s": 5})) as (url, _):
        figures["slow_clients"] = slow_clients(url)
    figures["tokens_per_minute"] = tokens_per_minute(served)
    figures["tenant_probe"] = tenant_probe(served)
    print(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
