"""Latency of a response-cache hit vs a fresh generation, through HTTP, on a `rebar serve` it
starts.

    .venv/bin/python scripts/bench_cache_hit.py [--model smollm2] [--port 8123] \
        [--fresh 10] [--hits 20]

Sends `--fresh` distinct greedy chat requests (each a cache miss), then `--hits` identical ones
(each served from the cache after the first), and prints both medians. Needs nothing but a free
port.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import httpx


def wait_ready(url: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/ready", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise SystemExit(f"server at {url} not ready after {timeout_s}s")


def timed_chat(url: str, model: str, prompt: str) -> tuple[float, str | None]:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 32,
        "temperature": 0,
    }
    started = time.perf_counter()
    response = httpx.post(url + "/v1/chat/completions", json=body, timeout=300)
    response.raise_for_status()
    return time.perf_counter() - started, response.headers.get("x-cache")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--fresh", type=int, default=10)
    parser.add_argument("--hits", type=int, default=20)
    args = parser.parse_args()
    env = {
        **os.environ,
        "REBAR_ENGINE__MAX_MODEL_LEN": "1024",
        "REBAR_ENGINE__KV_CACHE_MEMORY": str(128 * 2**20),
    }
    command = [
        sys.executable,
        "-m",
        "rebar.cli",
        "serve",
        "--model",
        args.model,
        "--port",
        str(args.port),
        "--embedding-model",
        "none",
    ]
    server = subprocess.Popen(
        command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    url = f"http://127.0.0.1:{args.port}"
    try:
        wait_ready(url)
        fresh = [
            timed_chat(url, args.model, f"Tell me a fact about the number {i}.")
            for i in range(args.fresh)
        ]
        hits = [
            timed_chat(url, args.model, "Tell me a fact about the number 3.")
            for _ in range(args.hits)
        ]
        if any(cache != "MISS" for _, cache in fresh) or any(cache != "HIT" for _, cache in hits):
            raise SystemExit("unexpected X-Cache values: is the cache enabled?")
        fresh_ms = statistics.median(t for t, _ in fresh) * 1000
        hit_ms = statistics.median(t for t, _ in hits) * 1000
        print(
            f"fresh generation p50 {fresh_ms:.1f} ms, cache hit "
            f"p50 {hit_ms:.1f} ms, ratio {fresh_ms / hit_ms:.0f}x"
        )
    finally:
        server.terminate()
        server.wait(30)


if __name__ == "__main__":
    main()
