"""The FastAPI application: middleware, routes, and model loading in the background.

The server answers /health at once; /ready and the model endpoints answer 503 until the models
are loaded and a warm-up generation has run.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from contextlib import asynccontextmanager
from pathlib import Path

import torch
from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from rebar.config import Settings
from rebar.engine.async_engine import AsyncEngine
from rebar.engine.contract import enforce_beside
from rebar.engine.engine_process import EngineProcess, EngineSpec
from rebar.engine.llm import LLM
from rebar.engine.sampling_params import SamplingParams
from rebar.errors import ConfigError, RebarError
from rebar.obs.tracing import Tracing
from rebar.server.auth import ApiKeyChecker
from rebar.server.embedding_queue import EmbeddingQueue
from rebar.server.errors import install_error_handlers
from rebar.server.middleware import (
    AdminKeyMiddleware,
    ApiKeyMiddleware,
    BodyLimitMiddleware,
    HTTPMetricsMiddleware,
    RequestIdMiddleware,
    api_key_id,
)
from rebar.server.response_cache import EmbeddingCache, ResponseCache
from rebar.server.routes import admin, chat, completions, misc, web
from rebar.server.state import Admission, ServedModels, ServerState
from rebar.server.telemetry import AccessLogMiddleware, TracingMiddleware

logger = logging.getLogger("rebar.server")


def served_name(model: str) -> str:
    """The id clients use: the alias, or the file/folder name of a path."""
    return (
        Path(model).name.removesuffix(".gguf")
        if ("/" in model or model.endswith(".gguf"))
        else model
    )


def load_models(settings: Settings) -> ServedModels:
    if settings.engine.num_threads:
        torch.set_num_threads(settings.engine.num_threads)
    served = ServedModels(created=int(time.time()))
    m = settings.models
    if m.chat:
        served.chat_name = served_name(m.chat)
        if settings.engine.separate_process:
            served.engine = EngineProcess.spawn(engine_spec(settings))
            served.chat = served.engine.text
        else:
            llm = LLM(
                m.chat,
                dtype=m.dtype,
                device=m.device,
                engine_config=settings.engine.to_engine_config(),
                dequantize=m.dequantize,
            )
            if llm.engine is None:
                raise ConfigError(
                    f"models.chat: {m.chat} is an embedding model; it cannot generate"
                )
            enforce_beside(llm)  # before the engine starts: a model that breaks it never serves
            served.chat, served.engine = llm, AsyncEngine(llm.engine)
        logger.info("loaded chat model %s in %.1fs", served.chat_name, served.chat.load_seconds)
    if m.embedding:
        served.embedding = LLM(m.embedding, dtype=m.dtype, device=m.device)
        enforce_beside(served.embedding)
        served.embedding_name = served_name(m.embedding)
        logger.info(
            "loaded embedding model %s in %.1fs",
            served.embedding_name,
            served.embedding.load_seconds,
        )
    return served


def engine_spec(settings: Settings) -> EngineSpec:
    """How the engine process loads the chat model: as this process would, and logs as it does."""
    m = settings.models
    assert m.chat is not None
    return EngineSpec(
        m.chat,
        dtype=m.dtype,
        device=m.device,
        engine_config=settings.engine.to_engine_config(),
        dequantize=m.dequantize,
        num_threads=settings.engine.num_threads,
        log_level=settings.logging.level,
        log_format=settings.logging.format,
    )


async def warm_up(models: ServedModels) -> None:
    if models.engine is not None:
        async for _ in models.engine.generate(
            "Hello", SamplingParams(max_tokens=2, temperature=0), "warm-up"
        ):
            pass
    if models.embedding is not None:
        await asyncio.to_thread(models.embedding.embed, ["warm-up"])


def create_app(
    settings: Settings, models: ServedModels | None = None, tracing: Tracing | None = None
) -> FastAPI:
    """The app for `settings`. Pass `models` to serve already-loaded models (tests); else they load
    in the background.

    `tracing` replaces the one built from `settings.tracing` (tests pass an in-memory exporter).
    """
    state = _server_state(settings, tracing)
    install_store(state, settings)
    state.metrics.attach(state)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        loop = asyncio.get_running_loop()
        loading = loop.create_task(_load_and_warm(state, settings, models))
        yield
        loading.cancel()
        if state.models.engine is not None:
            state.models.engine.shutdown()
        if state.embedding_queue is not None:
            state.embedding_queue.shutdown()
        if state.store is not None:
            await state.store.close()
        state.tracing.shutdown()

    app = FastAPI(title="rebar", version="0.1.0", lifespan=lifespan)
    app.state.rebar = state
    install_error_handlers(app)
    for router in (chat.router, completions.router, misc.router, admin.router):
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
    try:
        state.models = models if models is not None else await _in_thread(load_models, settings)
        if state.models.embedding is not None:
            embedder = state.models.embedding
            state.embedding_queue = EmbeddingQueue(
                lambda texts: [v.numpy() for v in embedder.embed(texts)],
                settings.limits.max_waiting_embedding_inputs,
                settings.limits.retry_after_s,
            )
        await warm_up(state.models)
        state.ready = True
        logger.info("ready: %s", ", ".join(state.models.names()))
    except asyncio.CancelledError:
        raise
    except RebarError as exc:  # a bad file or setting: its message says it all, no traceback
        logger.error("model loading failed: %s", exc)
        state.load_error = str(exc)
    except Exception as exc:  # keep serving /health and report the failure on /ready
        logger.exception("model loading failed")
        state.load_error = str(exc)


async def _in_thread(function, *args):
    # A plain daemon thread: a slow load must not keep the interpreter alive at shutdown.
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def run() -> None:
        try:
            result = function(*args)
            loop.call_soon_threadsafe(future.set_result, result)
        except BaseException as exc:
            loop.call_soon_threadsafe(future.set_exception, exc)

    threading.Thread(target=run, name="rebar-model-load", daemon=True).start()
    return await future
