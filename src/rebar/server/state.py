"""What one server holds while it runs, built whole by `create_app`: the model registry (and its
readiness) and reloads, the store and its caches, the gate, metrics and tracing."""

from __future__ import annotations

from dataclasses import dataclass

from starlette.requests import Request

from rebar.agents.tool_runs import ToolLoop
from rebar.documents.cache import SummaryCache
from rebar.obs.metrics import ServerMetrics
from rebar.obs.tracing import Tracing
from rebar.server.conversations import BackgroundRuns, ResponseStore
from rebar.server.pipeline.cache import EmbeddingCache, ResponseCache
from rebar.server.pipeline.gate import Gate
from rebar.serving.registry import ModelRegistry
from rebar.serving.reload import ModelReloads
from rebar.store import ResilientStore


@dataclass
class ServerState:
    registry: ModelRegistry
    reloads: ModelReloads
    store: ResilientStore
    gate: Gate
    responses: ResponseStore  # the Responses API's stored responses
    background: BackgroundRuns  # and its background runs
    metrics: ServerMetrics  # this app's own registry
    tracing: Tracing  # this app's own tracer provider
    request_timeout_s: float
    response_cache: ResponseCache | None = None  # None when caching is off
    embedding_cache: EmbeddingCache | None = None  # None when caching is off
    log_prompts: bool = False  # prompt and completion text in the access log
    ping_interval_s: float = 10.0
    cancel_wait_s: float = 5.0  # a cancelled background response's wait for its replica
    tool_loop: ToolLoop | None = None  # MCP servers and bounds of the Responses API's tool loops
    summaries: SummaryCache | None = None  # finished document summaries; None when not kept


def server_state(request: Request) -> ServerState:
    """The ServerState of the app serving `request` (`create_app` keeps it in `app.state.rebar`)."""
    state: ServerState = request.app.state.rebar
    return state
