"""GET /metrics over real HTTP: scripted traffic moves each counter by exactly what it should."""

from __future__ import annotations

import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from conftest import server_settings

CHAT = "/v1/chat/completions"
Samples = dict[tuple[str, tuple], float]


def scrape(url: str) -> Samples:
    response = httpx.get(url + "/metrics", timeout=30)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(response.text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def chat(url: str, content: str, **extra) -> httpx.Response:
    body = {
        "model": "smollm2",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 8,
        "temperature": 0,
        **extra,
    }
    return httpx.post(url + CHAT, json=body, timeout=120)


def stream_usage(response: httpx.Response) -> tuple[dict, str, dict]:
    """(usage, finish_reason, rebar's timing fields) from a streamed chat response."""
    import json

    usage, reason, timing = None, None, None
    for block in response.text.split("\n\n"):
        if block.startswith("data: {"):
            chunk = json.loads(block[6:])
            usage = chunk.get("usage") or usage
            timing = chunk.get("timing") or timing
            for choice in chunk["choices"]:
                reason = choice.get("finish_reason") or reason
    return usage, reason, timing


def timing_of(response: httpx.Response) -> dict[str, float]:
    """The x-rebar-timing header's fields, by name."""
    fields = (item.split("=") for item in response.headers["x-rebar-timing"].split(", "))
    return {key: float(value) for key, value in fields}


def test_scripted_traffic_moves_counters_exactly(server) -> None:
    url, _ = server
    before = scrape(url)
    first = chat(url, "What is the capital of France?")
    second = chat(url, "Name a colour.")
    streamed = chat(url, "Count to three.", stream=True, stream_options={"include_usage": True})
    repeat = chat(url, "What is the capital of France?")
    bad = chat(url, "Hi", model="no-such-model")
    embedded = httpx.post(
        url + "/v1/embeddings", json={"model": "minilm", "input": "metrics, measured"}, timeout=60
    )
    assert [r.status_code for r in (first, second, streamed, repeat, bad, embedded)] == [
        200,
        200,
        200,
        200,
        400,
        200,
    ]
    assert first.headers["x-cache"] == "MISS" and repeat.headers["x-cache"] == "HIT"

    usages = [first.json()["usage"], second.json()["usage"]]
    reasons = [
        first.json()["choices"][0]["finish_reason"],
        second.json()["choices"][0]["finish_reason"],
    ]
    stream_u, stream_reason, stream_timing = stream_usage(streamed)
    usages.append(stream_u)
    reasons.append(stream_reason)

    def delta(after: Samples, name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    # The middleware counts a request after its last byte: wait for the final one to land.
    deadline = time.monotonic() + 5
    while True:
        after = scrape(url)
        if (
            delta(
                after,
                "rebar_http_requests_total",
                route="/v1/embeddings",
                method="POST",
                status="200",
            )
            == 1
            or time.monotonic() > deadline
        ):
            break
        time.sleep(0.02)

    assert delta(after, "rebar_http_requests_total", route=CHAT, method="POST", status="200") == 4
    assert delta(after, "rebar_http_requests_total", route=CHAT, method="POST", status="400") == 1
    assert (
        delta(
            after, "rebar_http_requests_total", route="/v1/embeddings", method="POST", status="200"
        )
        == 1
    )
    assert delta(after, "rebar_http_request_duration_seconds_count", route=CHAT, method="POST") == 5

    for reason in set(reasons):
        assert delta(after, "rebar_requests_finished_total", finish_reason=reason) == reasons.count(
            reason
        )
    finished = sum(
        v - value(before, n, **dict(labels))
        for (n, labels), v in after.items()
        if n == "rebar_requests_finished_total"
    )
    assert finished == 3
    assert delta(after, "rebar_generation_tokens_total") == sum(
        u["completion_tokens"] for u in usages
    )
    assert delta(after, "rebar_prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages)
    for histogram in (
        "rebar_time_to_first_token_seconds",
        "rebar_request_queue_seconds",
        "rebar_request_prefill_seconds",
        "rebar_request_decode_seconds",
        "rebar_e2e_request_latency_seconds",
    ):
        assert delta(after, histogram + "_count") == 3, histogram
        assert delta(after, histogram + "_bucket", le="+Inf") == 3, histogram
    # One request at a time: each prompt in one prefill step (which gives the first token), then
    # one decode step per output, each the next token and any drafts kept before it.
    kept = [timing_of(first), timing_of(second), stream_timing]
    decode_steps = sum(
        u["completion_tokens"] - 1 - k["accepted_draft_tokens"] for u, k in zip(usages, kept)
    )
    assert delta(after, "rebar_inter_token_latency_seconds_count") == decode_steps
    steps = "rebar_engine_step_seconds"
    assert delta(after, steps + "_count", kind="prefill", model="smollm2") == 3
    assert delta(after, steps + "_count", kind="decode", model="smollm2") == decode_steps
    assert delta(after, steps + "_bucket", kind="decode", le="+Inf", model="smollm2") == delta(
        after, steps + "_count", kind="decode", model="smollm2"
    )
    assert delta(after, steps + "_sum", kind="decode", model="smollm2") > 0

    assert delta(after, "rebar_response_cache_total", result="hit") == 1
    assert delta(after, "rebar_response_cache_total", result="miss") == 3
    assert delta(after, "rebar_embedding_cache_total", result="miss") == 1
    assert delta(after, "rebar_embedding_cache_total", result="hit") == 0
    assert delta(after, "rebar_prefix_cache_queries_total", model="smollm2") > 0

    assert (
        value(after, "rebar_requests_running", model="smollm2") == 0
        and value(after, "rebar_requests_waiting", model="smollm2") == 0
    )
    assert 0 <= value(after, "rebar_kv_cache_usage_ratio", model="smollm2") <= 1
    assert (
        value(after, "rebar_rate_limited_total") == 0
        and value(after, "rebar_store_circuit_open") == 0
    )
    assert value(after, "rebar_model_load_seconds", model="smollm2") > 0
    info = {
        dict(labels)["model"]: dict(labels)
        for (name, labels), v in after.items()
        if name == "rebar_model_info" and v == 1
    }
    assert set(info) == {"smollm2", "minilm"} and info["smollm2"]["dtype"] == "float32"
    assert info["smollm2"]["version"] == "1" and info["smollm2"]["state"] == "loaded"
    assert value(after, "rebar_model_memory_bytes", model="smollm2") > 50 * 2**20


def test_metrics_is_open_and_unknown_paths_are_other() -> None:
    """With API keys configured /metrics needs none; a 401 and an unknown path are counted with
    bounded labels."""
    from fastapi.testclient import TestClient

    from rebar.server.app import create_app

    client = TestClient(
        create_app(server_settings(**{"server.api_keys": ["k1"]}))
    )  # no lifespan: nothing loads
    assert client.get("/v1/models").status_code == 401
    assert client.get("/some/random/path/123").status_code == 401
    response = client.get("/metrics")
    assert response.status_code == 200
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(response.text)
        for s in family.samples
    }
    assert (
        value(samples, "rebar_http_requests_total", route="/v1/models", method="GET", status="401")
        == 1
    )
    assert (
        value(samples, "rebar_http_requests_total", route="other", method="GET", status="401") == 1
    )
    assert not any("random" in str(labels) for _, labels in samples)


def test_bench_serve_reads_the_engine_step_and_the_serving_overhead(server) -> None:
    import asyncio

    from rebar_bench.serve import ServeBenchConfig, run_serve_bench

    url, _ = server
    config = ServeBenchConfig(url, num_prompts=2, input_words=8, output_tokens=8, ignore_eos=True)
    level = asyncio.run(run_serve_bench(config, [1])).levels[0]
    assert level.num_ok == 2
    step = level.engine_step_ms
    assert step is not None and step["steps"] == 2 * 7  # 8 tokens each: 7 from decode steps
    assert 0 < step["p50"] < level.itl_ms["p99"] and step["mean"] > 0
    # What HTTP adds per token: well below a step (a difference of two means, so it may come out
    # a little under zero when the path adds next to nothing).
    overhead = level.serving_overhead_mean_ms
    assert overhead is not None and -step["mean"] / 2 < overhead < 5 * step["mean"]
    assert level.to_dict()["serving_overhead_ms"] == level.serving_overhead_ms
