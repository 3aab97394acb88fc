"""Observability: Prometheus metrics, OpenTelemetry traces, JSON logs, torch-profiler traces."""

from rebar.obs.metrics import RequestTimer, ServerMetrics

__all__ = ["RequestTimer", "ServerMetrics"]
