"""OpenTelemetry tracing for one app: its own TracerProvider, W3C trace-context in, spans out.

Each app owns a provider (never the process-global one), so several apps in one process — tests,
or one process per model — keep their spans apart and shut down cleanly.

Spans of one generated request:

    HTTP POST /v1/chat/completions        (server span; continues an incoming `traceparent`)
    ├── rate limit                        (allowed / limited_by)
    │   └── store rate_limit              (one per call; outcome ok|error|timeout|short_circuit)
    ├── cache lookup                      (result hit|miss|bypass)
    │   └── store get
    └── generate                          (prompt/completion/cached tokens, finish reasons)
        ├── queue                         (engine arrival -> first scheduled)
        ├── prefill                       (first scheduled -> first token)
        └── decode                        (first token -> finished; output tokens, not per token)

The engine runs in its own thread and reports instants (`RequestTiming`), so queue/prefill/decode
are recorded after the fact with explicit start and end times.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
)
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from rebar.timing import RequestTiming

_PROPAGATOR = TraceContextTextMapPropagator()


class Tracing:
    """The tracer of one app and what it exports to.

    `exporter`: "none" (spans are sampled and get ids for logs and X-Trace-ID, but go nowhere),
    "console" (one JSON document per span on stdout), "otlp" (OTLP/HTTP protobuf to
    `otlp_endpoint`, batched). `span_exporter` overrides it (tests pass an in-memory one, exported
    synchronously).
    """

    def __init__(
        self,
        exporter: str = "none",
        otlp_endpoint: str = "",
        service_name: str = "rebar",
        sample_ratio: float = 1.0,
        span_exporter: SpanExporter | None = None,
    ) -> None:
        self.provider = TracerProvider(
            resource=Resource.create({"service.name": service_name}),
            sampler=ParentBased(TraceIdRatioBased(sample_ratio)),
        )
        if span_exporter is not None:
            self.provider.add_span_processor(SimpleSpanProcessor(span_exporter))
        elif exporter == "console":
            self.provider.add_span_processor(
                SimpleSpanProcessor(ConsoleSpanExporter(out=sys.stdout))
            )
        elif exporter == "otlp":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            self.provider.add_span_processor(
                BatchSpanProcessor(OTLPSpanExporter(endpoint=otlp_endpoint))
            )
        elif exporter != "none":
            raise ValueError(
                f"unknown trace exporter {exporter!r}: use 'none', 'console' or 'otlp'"
            )
        self.tracer: Tracer = self.provider.get_tracer("rebar")

    @classmethod
    def from_settings(cls, settings) -> Tracing:
        return cls(
            settings.exporter, settings.otlp_endpoint, settings.service_name, settings.sample_ratio
        )

    def shutdown(self) -> None:
        self.provider.shutdown()


def extract_context(headers: Mapping[str, str]) -> Context:
    """The caller's trace from a W3C `traceparent` (and `tracestate`) header; an empty context
    otherwise."""
    return _PROPAGATOR.extract(carrier=dict(headers))


def trace_id_of(span: Span) -> str | None:
    """32 lowercase hex digits, or None for a span without a valid context."""
    context = span.get_span_context()
    return format(context.trace_id, "032x") if context.is_valid else None


def current_trace_id() -> str | None:
    return trace_id_of(trace.get_current_span())


_EPOCH_OFFSET_NS = time.time_ns() - time.monotonic_ns()


def _epoch_ns(monotonic_s: float) -> int:
    """A `time.monotonic()` instant on the wall clock spans are stamped with."""
    return int(monotonic_s * 1e9) + _EPOCH_OFFSET_NS


def record_engine_phases(
    tracer: Tracer,
    parent: Span,
    timing: RequestTiming,
    num_prompt_tokens: int,
    num_cached_tokens: int,
    num_output_tokens: int,
) -> None:
    """Queue, prefill and decode as children of `parent`, stamped with the engine's own instants."""
    context = trace.set_span_in_context(parent)

    def phase(name: str, start: float, end: float, attributes: dict) -> None:
        span = tracer.start_span(
            name,
            context=context,
            kind=SpanKind.INTERNAL,
            start_time=_epoch_ns(start),
            attributes=attributes,
        )
        span.end(end_time=_epoch_ns(end))

    scheduled = timing.scheduled if timing.scheduled is not None else timing.finished
    phase("queue", timing.arrival, scheduled, {})
    if timing.scheduled is None:
        return
    first_token = timing.first_token if timing.first_token is not None else timing.finished
    phase(
        "prefill",
        timing.scheduled,
        first_token,
        {"rebar.prompt_tokens": num_prompt_tokens, "rebar.cached_prompt_tokens": num_cached_tokens},
    )
    if timing.first_token is not None:
        phase(
            "decode",
            timing.first_token,
            timing.finished,
            {"rebar.output_tokens": num_output_tokens},
        )


def end_generate_span(tracer: Tracer, span: Span, timer) -> None:
    """Close a request's `generate` span with its token counts, finish reasons and engine phases.

    `timer` is the request's `rebar.obs.metrics.RequestTimer`, which saw every output.
    """
    span.set_attribute("rebar.prompt_tokens", timer.num_prompt_tokens)
    span.set_attribute("rebar.cached_prompt_tokens", timer.num_cached_tokens)
    span.set_attribute("rebar.completion_tokens", timer.num_generated)
    reasons = [timer.finish_reasons.get(i, "abort") for i in range(timer.n)]
    span.set_attribute("rebar.finish_reasons", reasons)
    if timer.timing is not None:
        record_engine_phases(
            tracer,
            span,
            timer.timing,
            timer.num_prompt_tokens,
            timer.num_cached_tokens,
            timer.num_generated,
        )
    if any(reason == "error" for reason in reasons):
        span.set_status(Status(StatusCode.ERROR, "generation failed"))
    span.end()
