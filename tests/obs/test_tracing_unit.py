"""Tracing set-up from settings: exporters, sampling, traceparent parsing, engine phases on the wall
clock."""

from __future__ import annotations

import json
import time

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from rebar.config import Settings
from rebar.obs.tracing import Tracing, extract_context, record_engine_phases, trace_id_of
from rebar.timing import RequestTiming


def test_console_exporter_writes_each_span_as_json(capsys) -> None:
    tracing = Tracing.from_settings(
        Settings(tracing={"exporter": "console", "service_name": "rebar-test"}).tracing
    )
    with tracing.tracer.start_as_current_span("hello"):
        pass
    tracing.shutdown()
    span = json.loads(capsys.readouterr().out)
    assert (
        span["name"] == "hello" and span["resource"]["attributes"]["service.name"] == "rebar-test"
    )


def test_otlp_exporter_is_built_from_settings() -> None:
    tracing = Tracing.from_settings(
        Settings(
            tracing={"exporter": "otlp", "otlp_endpoint": "http://127.0.0.1:1/v1/traces"}
        ).tracing
    )
    processors = tracing.provider._active_span_processor._span_processors
    assert type(processors[0]).__name__ == "BatchSpanProcessor"
    assert processors[0].span_exporter._endpoint == "http://127.0.0.1:1/v1/traces"
    tracing.shutdown()


def test_unknown_exporter_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown trace exporter"):
        Tracing("jaeger")


def test_unsampled_traces_still_have_ids_and_a_callers_decision_is_kept() -> None:
    exporter = InMemorySpanExporter()
    tracing = Tracing(sample_ratio=0.0, span_exporter=exporter)
    span = tracing.tracer.start_span("dropped")
    assert trace_id_of(span) is not None and not span.is_recording()
    span.end()
    sampled_parent = extract_context(
        {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}
    )
    kept = tracing.tracer.start_span("kept", context=sampled_parent)
    kept.end()
    assert [s.name for s in exporter.get_finished_spans()] == ["kept"]
    assert trace_id_of(kept) == "4bf92f3577b34da6a3ce929d0e0e4736"


def test_malformed_traceparent_starts_a_fresh_trace() -> None:
    tracing = Tracing(span_exporter=InMemorySpanExporter())
    span = tracing.tracer.start_span(
        "x", context=extract_context({"traceparent": "00-zzzz-nothex-01"})
    )
    assert trace_id_of(span) is not None and span.parent is None


def test_engine_phases_are_placed_on_the_wall_clock() -> None:
    exporter = InMemorySpanExporter()
    tracing = Tracing(span_exporter=exporter)
    parent = tracing.tracer.start_span("generate")
    wall_before = time.time_ns()
    now = time.monotonic()
    record_engine_phases(
        tracing.tracer, parent, RequestTiming(now - 3.0, now - 2.5, now - 2.0, now), 10, 4, 7
    )
    wall_after = time.time_ns()
    parent.end()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    # The monotonic instant `now` maps onto the wall clock between the two readings around it
    # (a millisecond either side for the clocks' rounding), however long the calls took.
    assert wall_before - 1e6 <= spans["decode"].end_time <= wall_after + 1e6
    assert (spans["queue"].end_time - spans["queue"].start_time) == pytest.approx(0.5e9, rel=1e-3)
    assert (spans["decode"].end_time - spans["decode"].start_time) == pytest.approx(2.0e9, rel=1e-3)
    assert spans["prefill"].attributes["rebar.cached_prompt_tokens"] == 4


def test_a_request_that_never_ran_has_only_a_queue_span() -> None:
    exporter = InMemorySpanExporter()
    tracing = Tracing(span_exporter=exporter)
    parent = tracing.tracer.start_span("generate")
    now = time.monotonic()
    record_engine_phases(
        tracing.tracer, parent, RequestTiming(now - 1.0, None, None, now), 10, 0, 0
    )
    assert [s.name for s in exporter.get_finished_spans()] == ["queue"]
