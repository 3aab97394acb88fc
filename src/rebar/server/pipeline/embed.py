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


Input = str | tuple[int, ...]  # a text, or token ids read as given


async def _embed(
    state: ServerState, http: Request, request: EmbeddingRequest, model: EmbeddingModel
) -> tuple[Embeddings, dict[str, str]]:
    inputs = list(request.inputs)
    if not inputs or len(inputs) > MAX_EMBEDDING_INPUTS:
        raise InvalidRequestError(f"input must hold 1 to {MAX_EMBEDDING_INPUTS} inputs", "input")
    if any(not item for item in inputs):
        raise InvalidRequestError("inputs must not be empty", "input")
    if request.dimensions is not None and request.dimensions != model.dimensions:
        raise InvalidRequestError(
            f"this model returns {model.dimensions} dimensions; "
            f"dimensions={request.dimensions} is not supported",
            "dimensions",
        )
    size = sum(len(item) for item in inputs if isinstance(item, str))
    inputs, num_tokens = await off_loop(size, _within_window, model, inputs, request.truncate)
    passed = await state.gate.admit(http, num_tokens)
    headers = dict(passed.headers)
    tenant = passed.tenant
    cache_model = model.label if tenant is None else f"{model.label}:{tenant}"
    work = _with_cache(state.embedding_cache, model.embeddings, cache_model, inputs)
    vectors, headers["X-Cache"] = await unless_disconnected(http, work, state.request_timeout_s)
    return Embeddings(vectors, num_tokens, request.model or model.entry.name), headers


def _within_window(
    model: EmbeddingModel, inputs: list[Input], truncate: int | None
) -> tuple[list[Input], int]:
    """The inputs as the model will read them, and their tokens. One past the model's window is a
    400 naming the window, unless `truncate` asks to cut it; token ids must be the model's."""
    tokenizer, window = model.text.tokenizer, model.max_input_tokens
    limit = window if truncate in (None, -1) else truncate
    if truncate is not None and truncate != -1 and not 1 <= truncate <= window:
        raise InvalidRequestError(
            f"truncate_prompt_tokens must be -1 or 1 to {window}", "truncate_prompt_tokens"
        )
    texts = [item for item in inputs if isinstance(item, str)]
    encoded = iter(tokenizer.encode_batch(texts, add_special_tokens=True, truncated=False))
    read: list[Input] = []
    num_tokens = 0
    for i, item in enumerate(inputs):
        ids = next(encoded) if isinstance(item, str) else list(item)
        if not isinstance(item, str) and not all(0 <= t < model.vocab_size for t in ids):
            raise InvalidRequestError(
                f"input {i} holds token ids outside this model's vocabulary (0 to "
                f"{model.vocab_size - 1})",
                "input",
            )
        if len(ids) > limit:
            if truncate is None:
                raise InvalidRequestError(
                    f"input {i} is {len(ids)} tokens; this model reads at most {window} "
                    "(set truncate_prompt_tokens to cut longer inputs)",
                    "input",
                )
            cut = ids[: limit - 1] + ids[-1:] if tokenizer.is_special(ids[-1]) else ids[:limit]
            item = tuple(cut)
            ids = cut
        read.append(item)
        num_tokens += len(ids)
    return read, num_tokens


async def _with_cache(
    cache: EmbeddingCache | None, queue: EmbeddingQueue, cache_model: str, texts: list[Input]
) -> tuple[list[np.ndarray], str]:
    """Vectors for `texts` (texts or token ids), computing only the ones the embedding cache
    misses (each distinct input once). `cache_model` names the model's version, and the tenant
    when caches are isolated."""
    if cache is None:
        return await queue.embed(list(texts)), "MISS"
    found = await cache.get_many(cache_model, texts)
    missing = list(dict.fromkeys(t for t, v in zip(texts, found) if v is None))
    by_text: dict[Input, np.ndarray] = {}
    if missing:
        computed = await queue.embed(list(missing))
        await cache.put_many(cache_model, missing, computed)
        by_text = dict(zip(missing, computed))
    vectors = [v if v is not None else by_text[t] for t, v in zip(texts, found)]
    return vectors, "MISS" if missing else "HIT"
