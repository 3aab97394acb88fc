"""Observability: Prometheus metrics (more side services — tracing, logging, profiling — to come)."""

from rebar.obs.metrics import RequestTimer, ServerMetrics

__all__ = ["RequestTimer", "ServerMetrics"]
