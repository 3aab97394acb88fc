"""The FastAPI application: the HTTP shell (middleware, error shapes), the dialects' routes, and the
server's state built whole; the pinned models load in the background.

The server answers /health at once; /ready and the model endpoints answer 503 until the pinned
models are loaded and a warm-up generation has run.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager
from dataclasses import dataclass

import torch
from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from rebar.agents.mcp_servers import McpServers, ServerTarget
from rebar.agents.tool_runs import FlowLimits, ToolLoop
from rebar.config import Settings
from rebar.documents.cache import MemoryCache
from rebar.engine.async_engine import AsyncEngine
from rebar.engine.builder import LoadedModel, load_model
from rebar.engine.contract import enforce_beside
from rebar.errors import RebarError
from rebar.obs.metrics import ServerMetrics
from rebar.obs.tool_metrics import ToolMetrics
from rebar.obs.tracing import Tracing
from rebar.server.auth import ApiKeyChecker
from rebar.server.conversations import BackgroundRuns, ResponseStore
from rebar.server.dialects import (
    anthropic_messages,
    openai_chat,
    openai_completions,
    openai_embeddings,
    openai_responses,
)
from rebar.server.errors import ErrorShapes, install_error_handlers
from rebar.server.middleware import (
    AdminKeyMiddleware,
    ApiKeyMiddleware,
    BodyLimitMiddleware,
    HTTPMetricsMiddleware,
    RequestIdMiddleware,
    api_key_id,
)
from rebar.server.pipeline.cache import EmbeddingCache, ResponseCache
from rebar.server.pipeline.gate import Gate, WaitingRoom
from rebar.server.routes import admin, documents, ops, tokenize, web
from rebar.server.routes import models as model_routes
from rebar.server.state import ServerState
from rebar.server.telemetry import AccessLogMiddleware, TracingMiddleware
from rebar.serving.loading import engine_config, serve_loaded, warm_up
from rebar.serving.registry import ModelRegistry
from rebar.serving.reload import ModelReloads
from rebar.store import RateLimiter, RateLimits, ResilientStore, open_store

logger = logging.getLogger("rebar.server")

DIALECTS = (
    openai_chat,
    openai_completions,
    openai_embeddings,
    openai_responses,
    anthropic_messages,
)


@dataclass
class ServedModels:
    """Models loaded outside the registry, handed to `create_app` to serve as the `chat` and
    `embedding` shorthand entries (tests load them once for many apps). `engine` is the chat
    model's engine front (built when None)."""

    chat: LoadedModel | None = None
    embedding: LoadedModel | None = None
    engine: AsyncEngine | None = None


def load_models(settings: Settings) -> ServedModels:
    """The `chat` and `embedding` shorthand models, loaded in this thread."""
    if settings.engine.num_threads:
        torch.set_num_threads(settings.engine.num_threads)
    served = ServedModels()
    m = settings.models
    for entry in m.shorthand():
        budget = entry.memory_budget
        loaded = load_model(
            entry.model, m.dtype, m.device, engine_config(settings), m.dequantize, budget
        )
        enforce_beside(loaded)  # as a load by the registry would
        if entry.kind == "chat":
            served.chat = loaded
        else:
            served.embedding = loaded
    return served


def create_app(
    settings: Settings,
    models: ServedModels | None = None,
    tracing: Tracing | None = None,
    load_before_serving: bool = False,
) -> FastAPI:
    """The app for `settings`. Pass `models` to serve already-loaded models (tests); else they load
    in the background.

    `tracing` replaces the one built from `settings.tracing` (tests pass an in-memory exporter).
    `load_before_serving` makes the app's startup wait for the pinned models (and fail with their
    error) instead of answering 503 until they are loaded.
    """
    state = build_state(settings, tracing)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        loop = asyncio.get_running_loop()
        loading = loop.create_task(_load_and_warm(state, settings, models))
        if load_before_serving:  # a Ray Serve replica: taking traffic only once it can serve
            await loading
            if state.registry.load_error is not None:
                raise RuntimeError(f"model loading failed: {state.registry.load_error}")
        state.background.watch()
        yield
        loading.cancel()
        await state.background.close()
        if state.tool_loop is not None:
            await state.tool_loop.servers.close()
        await state.reloads.close()
        await state.registry.close()
        await state.store.close()
        state.tracing.shutdown()

    app = FastAPI(title="rebar", version="0.1.0", lifespan=lifespan)
    app.state.rebar = state
    shapes = ErrorShapes(((anthropic_messages.PREFIX, anthropic_messages.ERRORS),))
    install_error_handlers(app, shapes)
    for dialect in DIALECTS:
        app.include_router(dialect.router)
    for routes in (tokenize, ops, admin, model_routes, documents):
        app.include_router(routes.router)
    web.install(app)
    install_middleware(app, settings, state, shapes)
    return app


def build_state(settings: Settings, tracing: Tracing | None = None) -> ServerState:
    """Everything the server holds: the store (memory or Redis, behind a circuit breaker), its
    caches and rate limiter, the model registry and its reloads, metrics and tracing."""
    tracing = tracing or Tracing.from_settings(settings.tracing)
    s, c, limits = settings.store, settings.cache, settings.limits
    backend = (
        open_store("memory://", max_entries=s.memory_max_entries, max_bytes=s.memory_max_bytes)
        if s.backend == "memory"
        else open_store(s.url)
    )
    store = ResilientStore(
        backend,
        call_timeout_s=s.call_timeout_s,
        failure_threshold=s.failure_threshold,
        open_for_s=s.open_for_s,
        on_error=s.on_store_error,
        tracer=tracing.tracer,
    )
    tenants = c.tenant_isolation
    isolate = tenants == "on" or (tenants == "auto" and bool(settings.api_key_hashes()))
    waiting = WaitingRoom(
        limits.max_waiting_requests, limits.max_waiting_prompt_tokens, limits.retry_after_s
    )
    registry = ModelRegistry(settings)
    r = settings.responses
    state = ServerState(
        registry=registry,
        reloads=ModelReloads(registry, store, s.key_prefix),
        store=store,
        gate=Gate(_rate_limiter(settings, store), waiting, tracing, isolate),
        responses=ResponseStore(store, s.key_prefix, r.store_ttl_s, r.max_stored_bytes),
        background=BackgroundRuns(store, f"{s.key_prefix}:responses:cancel"),
        metrics=ServerMetrics(),
        tracing=tracing,
        request_timeout_s=limits.request_timeout_s,
        log_prompts=settings.logging.log_prompts,
        cancel_wait_s=r.cancel_wait_s,
    )
    if c.enabled:
        state.response_cache = ResponseCache(
            store, s.key_prefix, c.ttl_s, c.stale_s, c.lock_timeout_s, c.max_entry_bytes
        )
        state.embedding_cache = EmbeddingCache(store, s.key_prefix, c.embedding_ttl_s)
    state.tool_loop = tool_loop(settings, state.metrics, tracing)
    if settings.documents.cache_entries:
        state.summaries = MemoryCache(settings.documents.cache_entries)
    state.metrics.attach(state)
    return state


def tool_loop(settings: Settings, metrics: ServerMetrics, tracing: Tracing) -> ToolLoop:
    """The Responses API's MCP servers and tool-loop bounds, from `[mcp]`."""
    m = settings.mcp
    targets = [
        ServerTarget(
            s.label,
            s.url,
            s.command,
            s.args,
            dict(s.env),
            None if s.allowed_tools is None else frozenset(s.allowed_tools),
            s.call_timeout_s,
        )
        for s in m.servers
    ]
    servers = McpServers(targets, m.allowed_urls, m.connect_timeout_s, m.max_calls_per_server)
    limits = FlowLimits(
        m.max_tool_calls,
        m.call_timeout_s,
        m.max_parallel_calls,
        m.flow_timeout_s,
        m.max_output_chars,
    )
    return ToolLoop(servers, limits, ToolMetrics(metrics.registry), tracing.tracer)


def _rate_limiter(settings: Settings, store: ResilientStore) -> RateLimiter | None:
    r = settings.rate_limits
    per_key = {
        api_key_id(digest): RateLimits(e.requests_per_minute, e.tokens_per_minute)
        for digest, e in r.per_key.items()
    }
    if not (r.requests_per_minute or r.tokens_per_minute or per_key):
        return None
    default = RateLimits(r.requests_per_minute, r.tokens_per_minute)
    return RateLimiter(store, settings.store.key_prefix, default, per_key)


def install_middleware(
    app: FastAPI, settings: Settings, state: ServerState, shapes: ErrorShapes
) -> None:
    """Outermost last: metrics > request id > trace > access log > CORS > auth > admin auth > body
    > routes."""
    server = settings.server
    app.add_middleware(
        BodyLimitMiddleware,
        max_bytes=server.max_body_bytes,
        # an uploaded document may be as large as documents.max_bytes, plus its form's framing
        larger={documents.PATH: settings.documents.max_bytes + documents.FORM_FRAMING_BYTES},
        timeout_s=server.body_timeout_s,
        shapes=shapes,
    )
    admin_keys = ApiKeyChecker(settings.admin_key_hashes())
    app.add_middleware(AdminKeyMiddleware, checker=admin_keys, shapes=shapes)
    checker = ApiKeyChecker(settings.api_key_hashes())
    if checker.enabled:
        app.add_middleware(ApiKeyMiddleware, checker=checker, shapes=shapes)
    # Outside auth: a browser's preflight carries no key, and a 401 must carry CORS headers to be
    # readable.
    if server.cors_allow_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(server.cors_allow_origins),
            allow_methods=["*"],
            allow_headers=["*"],
            expose_headers=["X-Request-ID", "X-Trace-ID", "x-rebar-timing", "X-Cache"],
        )
    app.add_middleware(AccessLogMiddleware, routes=lambda: app.routes, clock=state.metrics.clock)
    app.add_middleware(TracingMiddleware, tracer=state.tracing.tracer, routes=lambda: app.routes)
    app.add_middleware(RequestIdMiddleware)
    app.add_middleware(HTTPMetricsMiddleware, metrics=state.metrics, routes=lambda: app.routes)


async def _load_and_warm(
    state: ServerState, settings: Settings, models: ServedModels | None
) -> None:
    try:
        if settings.engine.num_threads:
            torch.set_num_threads(settings.engine.num_threads)
        await _install_preloaded(state, settings, models or ServedModels())
        await state.reloads.adopt_current()  # a version reloaded before this process started
        await state.registry.start()  # the pinned models
        state.reloads.start()  # once subscribed, loaded models catch up with newer versions
        state.registry.ready = True
        logger.info("ready: %s", ", ".join(state.registry.loaded_names()))
    except asyncio.CancelledError:
        raise
    except RebarError as exc:  # a bad file or setting: its message says it all, no traceback
        logger.error("model loading failed: %s", exc)
        state.registry.load_error = str(exc)
    except Exception as exc:  # keep serving /health and report the failure on /ready
        logger.exception("model loading failed")
        state.registry.load_error = str(exc)


async def _install_preloaded(state: ServerState, settings: Settings, models: ServedModels) -> None:
    """`models`' chat and embedding, served as version 1 of their shorthand entries."""
    for entry in settings.models.shorthand():
        loaded = models.chat if entry.kind == "chat" else models.embedding
        if loaded is None:
            continue
        engine = models.engine if entry.kind == "chat" else None
        version = serve_loaded(settings, entry, 1, entry.model, loaded, engine)
        state.registry.install(entry.name, version)
        await warm_up(version)
