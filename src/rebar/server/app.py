"""The FastAPI application: middleware, routes, and model loading in the background.

The server answers /health at once; /ready and the model endpoints answer 503 until the models
are loaded and a warm-up generation has run.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager

import torch
from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from rebar.config import Settings
from rebar.errors import RebarError
from rebar.obs.tracing import Tracing
from rebar.server.auth import ApiKeyChecker
from rebar.server.errors import install_error_handlers
from rebar.server.middleware import (
    AdminKeyMiddleware,
    ApiKeyMiddleware,
    BodyLimitMiddleware,
    HTTPMetricsMiddleware,
    RequestIdMiddleware,
    api_key_id,
)
from rebar.server.model_instance import ModelInstance
from rebar.server.model_loading import instance_of, load_instance, warm_up
from rebar.server.model_reload import ModelReloads
from rebar.server.registry import ModelRegistry
from rebar.server.response_cache import EmbeddingCache, ResponseCache
from rebar.server.routes import admin, chat, completions, misc, web
from rebar.server.routes import models as model_routes
from rebar.server.state import Admission, ServedModels, ServerState
from rebar.server.telemetry import AccessLogMiddleware, TracingMiddleware

logger = logging.getLogger("rebar.server")


def load_models(settings: Settings) -> ServedModels:
    """The `chat` and `embedding` shorthand models, loaded in this thread (tests load them once
    and hand them to many apps)."""
    if settings.engine.num_threads:
        torch.set_num_threads(settings.engine.num_threads)
    served = ServedModels(created=int(time.time()))
    for entry in settings.models.shorthand():
        instance = load_instance(settings, entry, entry.model, 1)
        if entry.kind == "chat":
            served.chat_name, served.chat, served.engine = (
                entry.name,
                instance.text,
                instance.engine,
            )
        else:
            served.embedding_name, served.embedding = entry.name, instance.embedder
    return served


def _preloaded(settings: Settings, models: ServedModels) -> dict[str, ModelInstance]:
    """`models`' chat and embedding as instances of their shorthand entries."""
    instances = {}
    for entry in settings.models.shorthand():
        if entry.kind == "chat" and models.chat is not None and models.engine is not None:
            instances[entry.name] = instance_of(
                settings, entry, 1, entry.model, models.chat, models.engine
            )
        elif entry.kind == "embedding" and models.embedding is not None:
            instances[entry.name] = instance_of(settings, entry, 1, entry.model, models.embedding)
    return instances


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
    state = _server_state(settings, tracing)
    install_store(state, settings)
    state.registry = registry = ModelRegistry(settings)
    assert state.store is not None
    state.reloads = reloads = ModelReloads(registry, state.store, settings.store.key_prefix)
    state.metrics.attach(state)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        loop = asyncio.get_running_loop()
        loading = loop.create_task(_load_and_warm(state, settings, models))
        if load_before_serving:  # a Ray Serve replica: taking traffic only once it can serve
            await loading
            if state.load_error is not None:
                raise RuntimeError(f"model loading failed: {state.load_error}")
        yield
        loading.cancel()
        await reloads.close()
        await registry.close()
        if state.store is not None:
            await state.store.close()
        state.tracing.shutdown()

    app = FastAPI(title="rebar", version="0.1.0", lifespan=lifespan)
    app.state.rebar = state
    install_error_handlers(app)
    for router in (chat.router, completions.router, misc.router, admin.router, model_routes.router):
        app.include_router(router)
    web.install(app)
    install_middleware(app, settings, state)
    return app


def _server_state(settings: Settings, tracing: Tracing | None) -> ServerState:
    limits = settings.limits
    state = ServerState(
        Admission(
            limits.max_waiting_requests, limits.max_waiting_prompt_tokens, limits.retry_after_s
        ),
        request_timeout_s=limits.request_timeout_s,
        tracing=tracing or Tracing.from_settings(settings.tracing),
        log_prompts=settings.logging.log_prompts,
    )
    tenants = settings.cache.tenant_isolation
    state.isolate_tenants = tenants == "on" or (
        tenants == "auto" and bool(settings.api_key_hashes())
    )
    return state


def install_middleware(app: FastAPI, settings: Settings, state: ServerState) -> None:
    """Outermost last: metrics > request id > trace > access log > CORS > auth > admin auth > body
    > routes."""
    server = settings.server
    app.add_middleware(
        BodyLimitMiddleware, max_bytes=server.max_body_bytes, timeout_s=server.body_timeout_s
    )
    app.add_middleware(AdminKeyMiddleware, checker=ApiKeyChecker(settings.admin_key_hashes()))
    checker = ApiKeyChecker(settings.api_key_hashes())
    if checker.enabled:
        app.add_middleware(ApiKeyMiddleware, checker=checker)
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


def install_store(state: ServerState, settings: Settings) -> None:
    """The shared store (memory or Redis, behind a circuit breaker), the caches and the rate
    limiter."""
    from rebar.store import RateLimiter, RateLimits, ResilientStore, open_store

    s = settings.store
    backend = (
        open_store("memory://", max_entries=s.memory_max_entries, max_bytes=s.memory_max_bytes)
        if s.backend == "memory"
        else open_store(s.url)
    )
    state.store = ResilientStore(
        backend,
        call_timeout_s=s.call_timeout_s,
        failure_threshold=s.failure_threshold,
        open_for_s=s.open_for_s,
        on_error=s.on_store_error,
        tracer=state.tracing.tracer,
    )
    c = settings.cache
    if c.enabled:
        state.response_cache = ResponseCache(
            state.store, s.key_prefix, c.ttl_s, c.stale_s, c.lock_timeout_s, c.max_entry_bytes
        )
        state.embedding_cache = EmbeddingCache(state.store, s.key_prefix, c.embedding_ttl_s)
    r = settings.rate_limits
    per_key = {
        api_key_id(digest): RateLimits(e.requests_per_minute, e.tokens_per_minute)
        for digest, e in r.per_key.items()
    }
    if r.requests_per_minute or r.tokens_per_minute or per_key:
        state.rate_limiter = RateLimiter(
            state.store,
            s.key_prefix,
            RateLimits(r.requests_per_minute, r.tokens_per_minute),
            per_key,
        )


async def _load_and_warm(
    state: ServerState, settings: Settings, models: ServedModels | None
) -> None:
    assert state.registry is not None and state.reloads is not None
    try:
        if settings.engine.num_threads:
            torch.set_num_threads(settings.engine.num_threads)
        for name, instance in _preloaded(settings, models or ServedModels()).items():
            state.registry.install(name, instance)
            await warm_up(instance)
        await state.reloads.adopt_current()  # a version reloaded before this process started
        await state.registry.start()  # the pinned models
        state.reloads.start()  # once subscribed, loaded models catch up with newer versions
        state.ready = True
        logger.info("ready: %s", ", ".join(state.registry.loaded_names()))
    except asyncio.CancelledError:
        raise
    except RebarError as exc:  # a bad file or setting: its message says it all, no traceback
        logger.error("model loading failed: %s", exc)
        state.load_error = str(exc)
    except Exception as exc:  # keep serving /health and report the failure on /ready
        logger.exception("model loading failed")
        state.load_error = str(exc)
