"""What the server holds while it runs: the loaded models, the admission gate, readiness."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from starlette.requests import Request

from rebar.engine.async_engine import EngineFront
from rebar.engine.llm import LLM
from rebar.engine.model_text import ModelText
from rebar.obs.metrics import ServerMetrics
from rebar.obs.tracing import Tracing
from rebar.server.errors import APIError

if TYPE_CHECKING:  # types only: app.install_store and app._load_and_warm build them
    from rebar.server.embedding_queue import EmbeddingQueue
    from rebar.server.response_cache import EmbeddingCache, ResponseCache
    from rebar.store import RateLimiter, ResilientStore


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
    chat_name: str | None = None
    chat: ModelText | None = None  # an LLM, or only the text side when the engine has a process
    engine: EngineFront | None = None
    embedding_name: str | None = None
    embedding: LLM | None = None
    created: int = 0

    def names(self) -> list[str]:
        return [n for n in (self.chat_name, self.embedding_name) if n]


@dataclass
class ServerState:
    admission: Admission
    request_timeout_s: float
    ping_interval_s: float = 10.0
    models: ServedModels = field(default_factory=ServedModels)
    ready: bool = False
    load_error: str | None = None
    store: ResilientStore | None = None  # set by app.install_store
    response_cache: ResponseCache | None = None  # None when caching is off
    embedding_cache: EmbeddingCache | None = None  # None when caching is off
    embedding_queue: EmbeddingQueue | None = None  # once an embedding model is loaded
    rate_limiter: RateLimiter | None = None  # None when no limit is configured
    num_rate_limited: int = 0
    metrics: ServerMetrics = field(default_factory=ServerMetrics)  # this app's own registry
    tracing: Tracing = field(default_factory=Tracing)  # this app's own tracer provider
    log_prompts: bool = False  # prompt and completion text in the access log
    isolate_tenants: bool = (
        False  # response, embedding and prefix caches shared only within one client
    )

    def chat_model(self, name: str | None) -> tuple[ModelText, EngineFront]:
        self._require_ready()
        if self.models.chat is None or self.models.engine is None or name != self.models.chat_name:
            raise APIError(
                400,
                f"model {name!r} is not served for generation; "
                f"available: {self.models.chat_name!r}",
                "model",
                "model_not_found",
            )
        return self.models.chat, self.models.engine

    def embedding_model(self, name: str) -> LLM:
        self._require_ready()
        if self.models.embedding is None or name != self.models.embedding_name:
            raise APIError(
                400,
                f"model {name!r} is not served for embeddings; "
                f"available: {self.models.embedding_name!r}",
                "model",
                "model_not_found",
            )
        return self.models.embedding

    def engine_failure(self) -> str | None:
        """Why the chat engine stopped serving (its process exited), or None while it serves."""
        engine = self.models.engine
        return None if engine is None else engine.failure

    def _require_ready(self) -> None:
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
