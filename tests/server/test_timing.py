"""Each answer reports where its time went: `x-rebar-timing` (non-streaming) or `timing` in the
usage chunk (streaming)."""

from __future__ import annotations

import json
import time

import httpx

CHAT = "/v1/chat/completions"
KEYS = (
    "queue_ms",
    "prefill_ms",
    "decode_ms",
    "cached_prompt_tokens",
    "draft_tokens",
    "accepted_draft_tokens",
)


def parse_header(value: str) -> dict[str, float]:
    fields = dict(part.strip().split("=", 1) for part in value.split(","))
    assert tuple(fields) == KEYS
    return {k: float(v) for k, v in fields.items()}


def chat(url: str, content: str, **extra) -> httpx.Response:
    body = {
        "model": "smollm2",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 6,
        "ignore_eos": True,
        **extra,
    }
    return httpx.post(url + CHAT, json=body, timeout=120)


def test_header_splits_the_request_and_counts_prefix_cache_hits(server) -> None:
    url, _ = server
    prompt = "Write one sentence about the timing of bridges and rivers."
    started = time.monotonic()
    first = chat(url, prompt, temperature=0.8)  # sampled: the response cache stays out of the way
    elapsed_ms = (time.monotonic() - started) * 1e3
    assert first.status_code == 200
    timing = parse_header(first.headers["x-rebar-timing"])
    assert timing["queue_ms"] >= 0 and timing["prefill_ms"] > 0 and timing["decode_ms"] > 0
    assert timing["queue_ms"] + timing["prefill_ms"] + timing["decode_ms"] <= elapsed_ms
    assert (
        timing["cached_prompt_tokens"]
        == first.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    )

    second = chat(url, prompt, temperature=0.8)
    again = parse_header(second.headers["x-rebar-timing"])
    assert again["cached_prompt_tokens"] > 0  # the prompt's full blocks came from the prefix cache
    assert (
        again["cached_prompt_tokens"]
        == second.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    )


def test_stream_carries_timing_in_the_usage_chunk(server) -> None:
    url, _ = server
    response = chat(
        url,
        "Say something short.",
        temperature=0.8,
        stream=True,
        stream_options={"include_usage": True},
    )
    assert response.status_code == 200 and "x-rebar-timing" not in response.headers
    chunks = [json.loads(b[6:]) for b in response.text.split("\n\n") if b.startswith("data: {")]
    usage_chunks = [c for c in chunks if c.get("usage")]
    assert len(usage_chunks) == 1 and tuple(usage_chunks[0]["timing"]) == KEYS
    timing = usage_chunks[0]["timing"]
    assert timing["prefill_ms"] > 0 and timing["decode_ms"] > 0
    assert (
        timing["cached_prompt_tokens"]
        == usage_chunks[0]["usage"]["prompt_tokens_details"]["cached_tokens"]
    )
    assert all("timing" not in c for c in chunks if not c.get("usage"))


def test_cache_hit_has_no_engine_timing(server) -> None:
    url, _ = server
    first = chat(url, "Name a prime number.", temperature=0)
    hit = chat(url, "Name a prime number.", temperature=0)
    assert first.headers["x-cache"] == "MISS" and "x-rebar-timing" in first.headers
    assert hit.headers["x-cache"] == "HIT" and "x-rebar-timing" not in hit.headers
    assert hit.json()["choices"] == first.json()["choices"]
