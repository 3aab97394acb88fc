"""Prometheus instruments of the server-side tool loop, on the app's own registry:

- `rebar_tool_calls_total{server, outcome}`: MCP tool calls by server label and how they ended
  (ok, error, timeout, cancelled, skipped);
- `rebar_tool_call_duration_seconds{server}`: from the call's start to its end;
- `rebar_tool_flows_total{status}`: tool loops by the response's final status.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

TOOL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class ToolMetrics:
    """Tool-call counts, durations and failures; flows by status."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.calls = Counter(
            "rebar_tool_calls",
            "MCP tool calls by server label and outcome.",
            ["server", "outcome"],
            registry=registry,
        )
        self.duration = Histogram(
            "rebar_tool_call_duration_seconds",
            "Duration of MCP tool calls.",
            ["server"],
            buckets=TOOL_BUCKETS,
            registry=registry,
        )
        self.flows = Counter(
            "rebar_tool_flows",
            "Responses that ran a tool loop, by final status.",
            ["status"],
            registry=registry,
        )

    def observe_call(self, server: str, outcome: str, seconds: float) -> None:
        self.calls.labels(server, outcome).inc()
        self.duration.labels(server).observe(seconds)
