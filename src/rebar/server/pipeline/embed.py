"""The pipeline for embeddings: lease the embedding model, check the inputs, pass the gate, then
the embedding cache and the model's queue for what it misses; the dialect renders the vectors."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from fastapi.responses import JSONResponse, Response
from starlette.requests import Request

from rebar.errors import InvalidRequestError
from rebar.server.pipeline.cache import EmbeddingCache
from rebar.server.pipeline.generate import unless_disconnected
from rebar.server.pipeline.lease import VERSION_HEADER
from rebar.server.pipeline.prepare import off_loop
from rebar.server.pipeline.request import EmbeddingRequest
from rebar.server.state import ServerState
from rebar.serving.embedding_queue import EmbeddingQueue
from rebar.serving.instances import EmbeddingModel

MAX_EMBEDDING_INPUTS = 2048


@dataclass(frozen=True)
class Embeddings:
    """One vector per input, in order, and the tokens the model read for them."""

    vectors: list[np.ndarray]
    num_tokens: int
    model: str  # the name the client asked for


async def embed_response(
    state: ServerState,
    http: Request,
    request: EmbeddingRequest,
    render: Callable[[Embeddings], dict[str, Any]],
) -> Response:
    state.registry.check_ready()
    lease = await state.registry.acquire_embedding(request.model)
    try:
        body, headers = await _embed(state, http, request, lease.version)
    finally:
        lease.release()
    headers[VERSION_HEADER] = lease.version.label
    return JSONResponse(render(body), headers=headers)


async def _embed(
    state: ServerState, http: Request, request: EmbeddingRequest, model: EmbeddingModel
) -> tuple[Embeddings, dict[str, str]]:
    texts = list(request.inputs)
    if not texts or len(texts) > MAX_EMBEDDING_INPUTS:
        raise InvalidRequestError(f"input must hold 1 to {MAX_EMBEDDING_INPUTS} strings", "input")
    if any(not text for text in texts):
        raise InvalidRequestError("input strings must not be empty", "input")
    if request.dimensions is not None and request.dimensions != model.dimensions:
        raise InvalidRequestError(
            f"this model returns {model.dimensions} dimensions; "
            f"dimensions={request.dimensions} is not supported",
            "dimensions",
        )
    tokenizer = model.text.tokenizer

    def count() -> int:
        return sum(len(ids) for ids in tokenizer.encode_batch(texts, add_special_tokens=True))

    num_tokens = await off_loop(sum(len(t) for t in texts), count)
    passed = await state.gate.admit(http, num_tokens)
    headers = dict(passed.headers)
    tenant = passed.tenant
    cache_model = model.label if tenant is None else f"{model.label}:{tenant}"
    work = _with_cache(state.embedding_cache, model.embeddings, cache_model, texts)
    vectors, headers["X-Cache"] = await unless_disconnected(http, work, state.request_timeout_s)
    return Embeddings(vectors, num_tokens, request.model or model.entry.name), headers


async def _with_cache(
    cache: EmbeddingCache | None, queue: EmbeddingQueue, cache_model: str, texts: list[str]
) -> tuple[list[np.ndarray], str]:
    """Vectors for `texts`, computing only the ones the embedding cache misses (each distinct text
    once). `cache_model` names the model's version, and the tenant when caches are isolated."""
    if cache is None:
        return await queue.embed(texts), "MISS"
    found = await cache.get_many(cache_model, texts)
    missing = list(dict.fromkeys(t for t, v in zip(texts, found) if v is None))
    by_text = {}
    if missing:
        computed = await queue.embed(missing)
        await cache.put_many(cache_model, missing, computed)
        by_text = dict(zip(missing, computed))
    vectors = [v if v is not None else by_text[t] for t, v in zip(texts, found)]
    return vectors, "MISS" if missing else "HIT"
