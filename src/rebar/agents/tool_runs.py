"""Running a model turn's tool calls: each traced (a `tool call` span under the current one),
counted and timed (`ToolMetrics`), logged with the request id, bounded by its own timeout, and
isolated (a failure, a timeout or a bad argument is that call's error, never the flow's)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from typing import Any

from opentelemetry.trace import Status, StatusCode, Tracer

from rebar.agents.mcp_servers import Connection, McpServers, ToolResult
from rebar.obs.tool_metrics import ToolMetrics

logger = logging.getLogger("rebar.agents")


@dataclass(frozen=True)
class FlowLimits:
    """A tool loop's bounds: calls per response (unless the request says), seconds per call,
    calls of one response at once, seconds for the whole loop, characters of a tool's output the
    model reads."""

    max_tool_calls: int = 32
    call_timeout_s: float = 60.0
    max_parallel_calls: int = 8
    flow_timeout_s: float = 600.0
    max_output_chars: int = 32768


@dataclass(frozen=True)
class PendingCall:
    """A call the model made: its MCP server (label and connection), tool and JSON arguments."""

    key: str  # the caller's handle for it (its output item's id)
    label: str
    connection: Connection
    name: str
    arguments: str


@dataclass
class ToolLoop:
    """What a server holds for tool loops: its MCP servers, bounds, instruments and tracer."""

    servers: McpServers
    limits: FlowLimits
    metrics: ToolMetrics
    tracer: Tracer

    async def run_all(
        self, calls: Sequence[PendingCall], slots: asyncio.Semaphore
    ) -> AsyncGenerator[tuple[PendingCall, ToolResult], None]:
        """Run `calls` at once (at most `slots` of the response at a time) and yield each with
        its result as it ends. Leaving early (a cancel) cancels every call still running."""
        tasks = {asyncio.create_task(self._slotted(call, slots)): call for call in calls}
        pending = set(tasks)
        try:
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    yield tasks[task], task.result()
        finally:
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

    async def _slotted(self, call: PendingCall, slots: asyncio.Semaphore) -> ToolResult:
        async with slots:
            return await self.call(call)

    async def call(self, call: PendingCall) -> ToolResult:
        """One call on its server, traced, counted and logged; cancelling it cancels the call."""
        attributes = {"rebar.mcp.server": call.label, "rebar.mcp.tool": call.name}
        started = time.monotonic()
        outcome = "cancelled"
        with self.tracer.start_as_current_span("tool call", attributes=attributes) as span:
            try:
                result = await self._run(call)
                outcome = result.outcome
                span.set_attribute("rebar.mcp.outcome", outcome)
                if result.error is not None:
                    span.set_status(Status(StatusCode.ERROR, result.error))
                return result
            finally:
                seconds = time.monotonic() - started
                self.metrics.observe_call(call.label, outcome, seconds)
                fields = {**attributes, "outcome": outcome, "duration_s": round(seconds, 4)}
                logger.info(
                    "tool call %s.%s: %s", call.label, call.name, outcome, extra={"fields": fields}
                )

    async def _run(self, call: PendingCall) -> ToolResult:
        arguments = _arguments(call.arguments)
        if arguments is None:
            return ToolResult(None, "the arguments are not a JSON object", "error")
        timeout_s = call.connection.target.call_timeout_s or self.limits.call_timeout_s
        result = await call.connection.call(call.name, arguments, timeout_s)
        if result.output is not None and len(result.output) > self.limits.max_output_chars:
            cut = result.output[: self.limits.max_output_chars]
            return ToolResult(cut + "\n[output cut: too long]", None, result.outcome)
        return result


def _arguments(text: str) -> dict[str, Any] | None:
    try:
        value = json.loads(text or "{}")
    except ValueError:
        return None
    return value if isinstance(value, dict) else None
