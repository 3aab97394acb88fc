"""Traces of real requests, captured with an in-memory exporter: structure, attributes, continued
traceparent."""

from __future__ import annotations

import time

import httpx
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from conftest import server_settings
from live_server import live_server

CHAT = "/v1/chat/completions"
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN_ID = "00f067aa0ba902b7"


@pytest.fixture(scope="module")
def traced(served_models):
    from rebar.engine.async_engine import AsyncEngine
    from rebar.obs.tracing import Tracing
    from rebar.server.app import create_app

    exporter = InMemorySpanExporter()
    served_models.engine = AsyncEngine(served_models.chat.engine)
    settings = server_settings(**{"rate_limits.requests_per_minute": 10_000})
    app = create_app(settings, served_models, tracing=Tracing(span_exporter=exporter))
    with live_server(app) as url:
        yield url, exporter


def spans_of_trace(
    exporter: InMemorySpanExporter, trace_id: str, wait_for: str, timeout: float = 5.0
) -> dict:
    """{name: span} of one trace, once a span named `wait_for` (the last to end) has been exported."""
    deadline = time.monotonic() + timeout
    while True:
        spans = [
            s
            for s in exporter.get_finished_spans()
            if format(s.context.trace_id, "032x") == trace_id
        ]
        if any(s.name == wait_for for s in spans) or time.monotonic() > deadline:
            return {s.name: s for s in spans}
        time.sleep(0.02)


def chat(url: str, content: str, headers: dict | None = None, **extra) -> httpx.Response:
    body = {
        "model": "smollm2",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 5,
        **extra,
    }
    return httpx.post(url + CHAT, json=body, headers=headers or {}, timeout=120)


def test_generated_request_continues_the_callers_trace_with_every_phase(traced) -> None:
    url, exporter = traced
    traceparent = f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01"
    response = chat(
        url,
        "Trace me, please.",
        {"traceparent": traceparent, "X-Request-ID": "traced-1"},
        temperature=0,
    )
    assert response.status_code == 200
    assert response.headers["x-trace-id"] == TRACE_ID
    usage = response.json()["usage"]

    spans = spans_of_trace(exporter, TRACE_ID, f"POST {CHAT}")
    server = spans[f"POST {CHAT}"]
    assert server.kind == SpanKind.SERVER
    assert format(server.parent.span_id, "016x") == PARENT_SPAN_ID and server.parent.is_remote
    assert (
        server.attributes["http.route"] == CHAT
        and server.attributes["http.response.status_code"] == 200
    )
    assert server.attributes["rebar.request_id"] == "traced-1"

    def parent_of(name: str):
        return spans[name].parent.span_id

    for child in ("rate limit", "cache lookup", "generate"):
        assert parent_of(child) == server.context.span_id, child
    assert spans["rate limit"].attributes["rebar.rate_limit.allowed"] is True
    assert parent_of("store rate_limit") == spans["rate limit"].context.span_id
    assert spans["store rate_limit"].attributes["rebar.store.outcome"] == "ok"
    assert spans["store rate_limit"].kind == SpanKind.CLIENT
    assert spans["cache lookup"].attributes["rebar.cache.result"] == "miss"
    assert parent_of("store get") == spans["cache lookup"].context.span_id

    generate = spans["generate"]
    assert generate.attributes["rebar.prompt_tokens"] == usage["prompt_tokens"]
    assert generate.attributes["rebar.completion_tokens"] == usage["completion_tokens"]
    assert tuple(generate.attributes["rebar.finish_reasons"]) == ("length",)
    queue, prefill, decode = spans["queue"], spans["prefill"], spans["decode"]
    for phase in (queue, prefill, decode):
        assert phase.parent.span_id == generate.context.span_id
    assert (
        queue.end_time <= prefill.start_time + 1000 and prefill.end_time <= decode.start_time + 1000
    )  # ns, rounding
    assert prefill.end_time > prefill.start_time and decode.end_time > decode.start_time
    assert decode.attributes["rebar.output_tokens"] == usage["completion_tokens"]
    assert prefill.attributes["rebar.prompt_tokens"] == usage["prompt_tokens"]
    assert generate.start_time <= queue.start_time and decode.end_time <= generate.end_time
    assert server.start_time <= generate.start_time and generate.end_time <= server.end_time


def test_streamed_request_without_traceparent_starts_a_new_trace(traced) -> None:
    url, exporter = traced
    response = chat(url, "Stream a trace.", temperature=0.7, stream=True)
    assert response.status_code == 200
    trace_id = response.headers["x-trace-id"]
    assert len(trace_id) == 32 and trace_id != TRACE_ID
    spans = spans_of_trace(exporter, trace_id, f"POST {CHAT}")
    server = spans[f"POST {CHAT}"]
    assert server.parent is None
    assert "cache lookup" not in spans  # a sampled request never touches the response cache
    assert {"generate", "queue", "prefill", "decode"} <= set(spans)
    assert (
        spans["generate"].end_time <= server.end_time
    )  # the server span lasts until the stream's last byte


def test_rejected_and_unknown_requests_are_traced_with_their_status(traced) -> None:
    url, exporter = traced
    response = chat(url, "hi", model="no-such-model")
    assert response.status_code == 400
    spans = spans_of_trace(exporter, response.headers["x-trace-id"], f"POST {CHAT}")
    assert spans[f"POST {CHAT}"].attributes["http.response.status_code"] == 400
    assert "generate" not in spans

    missing = httpx.get(url + "/no/such/path", timeout=10)
    spans = spans_of_trace(exporter, missing.headers["x-trace-id"], "GET other")
    assert spans["GET other"].attributes["http.response.status_code"] == 404
