"""What the server holds while it runs: the model registry, the admission gate, readiness."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fastapi.responses import Response
from starlette.requests import Request

from rebar.engine.async_engine import EngineFront
from rebar.engine.llm import LLM
from rebar.engine.model_text import ModelText
from rebar.obs.metrics import ServerMetrics
from rebar.obs.tracing import Tracing
from rebar.server.errors import APIError
from rebar.server.model_instance import ModelInstance

if TYPE_CHECKING:  # types only: app.install_store and create_app build them
    from rebar.server.model_reload import ModelReloads
    from rebar.server.registry import Kind, ModelRegistry
    from rebar.server.response_cache import EmbeddingCache, ResponseCache
    from rebar.store import RateLimiter, ResilientStore


VERSION_HEADER = "X-Rebar-Model-Version"  # which version of the model produced a response


class Admission:
    """Bounded waiting queue: requests admitted but not yet producing output, and their prompt
    tokens.

    Beyond either limit a request gets 503 with Retry-After instead of queueing without bound.
    """

    def __init__(self, max_requests: int, max_prompt_tokens: int, retry_after_s: int) -> None:
        self.max_requests, self.max_prompt_tokens, self.retry_after_s = (
            max_requests,
            max_prompt_tokens,
            retry_after_s,
        )
        self.waiting_requests = 0
        self.waiting_prompt_tokens = 0
        self.num_rejected = 0

    def admit(self, num_prompt_tokens: int) -> Ticket:
        if (
            self.waiting_requests + 1 > self.max_requests
            or self.waiting_prompt_tokens + num_prompt_tokens > self.max_prompt_tokens
        ):
            self.num_rejected += 1
            raise APIError(
                503,
                "the server is at capacity; retry later",
                code="overloaded",
                headers={"Retry-After": str(self.retry_after_s)},
            )
        self.waiting_requests += 1
        self.waiting_prompt_tokens += num_prompt_tokens
        return Ticket(self, num_prompt_tokens)


@dataclass
class Ticket:
    admission: Admission
    num_prompt_tokens: int
    released: bool = False

    def release(self) -> None:
        """The request started producing (or ended): it no longer counts as waiting. Idempotent."""
        if not self.released:
            self.released = True
            self.admission.waiting_requests -= 1
            self.admission.waiting_prompt_tokens -= self.num_prompt_tokens


@dataclass
class ServedModels:
    """Models loaded outside the registry, handed to `create_app` to serve as the `chat` and
    `embedding` shorthand entries (tests load them once for many apps); also what `state.models`
    shows of the default chat and embedding models now."""

    chat_name: str | None = None
    chat: ModelText | None = None  # an LLM, or only the text side when the engine has a process
    engine: EngineFront | None = None
    embedding_name: str | None = None
    embedding: LLM | None = None
    created: int = 0

    def names(self) -> list[str]:
        return [n for n in (self.chat_name, self.embedding_name) if n]


Build = Callable[[ModelInstance], Awaitable[Response]]


@dataclass
class ServerState:
    admission: Admission
    request_timeout_s: float
    ping_interval_s: float = 10.0
    registry: ModelRegistry | None = None  # set by create_app
    reloads: ModelReloads | None = None  # set by create_app, with the store
    ready: bool = False
    load_error: str | None = None
    store: ResilientStore | None = None  # set by app.install_store
    response_cache: ResponseCache | None = None  # None when caching is off
    embedding_cache: EmbeddingCache | None = None  # None when caching is off
    rate_limiter: RateLimiter | None = None  # None when no limit is configured
    num_rate_limited: int = 0
    metrics: ServerMetrics = field(default_factory=ServerMetrics)  # this app's own registry
    tracing: Tracing = field(default_factory=Tracing)  # this app's own tracer provider
    log_prompts: bool = False  # prompt and completion text in the access log
    isolate_tenants: bool = (
        False  # response, embedding and prefix caches shared only within one client
    )

    @property
    def models(self) -> ServedModels:
        """The default chat and embedding models as loaded now (None where not loaded)."""
        view = ServedModels(created=self.registry.created if self.registry else 0)
        if self.registry is None:
            return view
        view.chat_name = self.registry.default_name("chat")
        view.embedding_name = self.registry.default_name("embedding")
        if view.chat_name and (chat := self.registry.slots[view.chat_name].current):
            view.chat, view.engine = chat.text, chat.engine
        if view.embedding_name and (embedding := self.registry.slots[view.embedding_name].current):
            view.embedding = embedding.embedder
        return view

    async def serve(self, name: str | None, kind: Kind, build: Build) -> Response:
        """`build(instance)`'s response on a lease of the model's current version, held until the
        response has been sent; the response names the version in `X-Rebar-Model-Version`."""
        self.require_ready()
        assert self.registry is not None
        lease = await self.registry.acquire(name, kind)
        try:
            response = await build(lease.instance)
        except BaseException:
            lease.release()
            raise
        response.headers[VERSION_HEADER] = lease.instance.label
        return lease.hold_until_sent(response)

    def engine_failure(self) -> str | None:
        """Why a chat engine stopped serving (its process exited), or None while they serve."""
        for instance in self.registry.loaded() if self.registry else []:
            if instance.engine is not None and instance.engine.failure is not None:
                return instance.engine.failure
        return None

    def require_ready(self) -> None:
        failure = self.engine_failure()
        if failure is not None:
            raise APIError(503, failure, code="engine_stopped")
        if not self.ready:
            message = (
                f"model failed to load: {self.load_error}"
                if self.load_error
                else "the model is still loading"
            )
            raise APIError(503, message, code="not_ready", headers={"Retry-After": "5"})


def server_state(request: Request) -> ServerState:
    """The ServerState of the app serving `request` (`create_app` keeps it in `app.state.rebar`)."""
    state: ServerState = request.app.state.rebar
    return state
