"""Embeddings, tokenize/detokenize, health, readiness and metrics."""

from __future__ import annotations

import base64

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from rebar.errors import InvalidRequestError
from rebar.server import completion_flow as flow
from rebar.server import generation, prompts
from rebar.server.convert import template_messages
from rebar.server.embedding_queue import EmbeddingQueue
from rebar.server.errors import APIError
from rebar.server.model_instance import ModelInstance
from rebar.server.schemas import DetokenizeRequest, EmbeddingRequest, TokenizeRequest
from rebar.server.state import ServerState, server_state

router = APIRouter()
MAX_EMBEDDING_INPUTS = 2048


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    """Liveness: the process answers, and its engine (when it runs in a process of its own) has not
    exited."""
    failure = server_state(request).engine_failure()
    if failure is not None:
        return JSONResponse({"status": "failed", "error": failure}, status_code=503)
    return JSONResponse({"status": "ok"})


@router.get("/ready")
async def ready(request: Request) -> JSONResponse:
    """Readiness: 200 once every model is loaded and a warm-up generation has run."""
    state = server_state(request)
    error = state.engine_failure() or state.load_error
    if state.ready and error is None:
        assert state.registry is not None
        return JSONResponse({"status": "ready", "models": state.registry.loaded_names()})
    body = {"status": "failed" if error else "loading", "error": error}
    return JSONResponse(body, status_code=503, headers={"Retry-After": "5"})


@router.get("/metrics", include_in_schema=False)
async def metrics(request: Request) -> Response:
    """Prometheus text exposition of this server's registry (open without an API key)."""
    return Response(server_state(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.post("/v1/embeddings")
async def embeddings(body: EmbeddingRequest, request: Request) -> Response:
    state = server_state(request)
    return await state.serve(body.model, "embedding", lambda m: _embed(state, request, body, m))


async def _embed(
    state: ServerState, request: Request, body: EmbeddingRequest, model: ModelInstance
) -> JSONResponse:
    llm, queue = model.embedder, model.embedding_queue
    assert llm is not None and queue is not None, "an embedding model's instance has both"
    texts = [body.input] if isinstance(body.input, str) else body.input
    if not texts or len(texts) > MAX_EMBEDDING_INPUTS:
        raise InvalidRequestError(f"input must hold 1 to {MAX_EMBEDDING_INPUTS} strings", "input")
    if any(not text for text in texts):
        raise InvalidRequestError("input strings must not be empty", "input")
    dim = llm.config.hidden_size
    if body.dimensions is not None and body.dimensions != dim:
        raise InvalidRequestError(
            f"this model returns {dim} dimensions; dimensions={body.dimensions} is not supported",
            "dimensions",
        )
    num_tokens = await prompts.count_tokens(llm, texts)
    headers = await flow.check_rate_limit(state, request, num_tokens)
    tenant = flow.tenant(state, request)
    cache_model = model.label if tenant is None else f"{model.label}:{tenant}"
    work = _embed_with_cache(state, queue, cache_model, texts)
    vectors, headers["X-Cache"] = await generation.unless_disconnected(
        request, work, state.request_timeout_s
    )
    data = []
    for index, vector in enumerate(vectors):
        values = np.asarray(vector, dtype=np.float32)
        encoded = (
            base64.b64encode(values.tobytes()).decode()
            if body.encoding_format == "base64"
            else values.tolist()
        )
        data.append({"object": "embedding", "index": index, "embedding": encoded})
    usage = {"prompt_tokens": num_tokens, "total_tokens": num_tokens}
    return JSONResponse(
        {"object": "list", "data": data, "model": body.model, "usage": usage}, headers=headers
    )


async def _embed_with_cache(
    state: ServerState, embedder: EmbeddingQueue, cache_model: str, texts: list[str]
) -> tuple[list[np.ndarray], str]:
    """Vectors for `texts`, computing only the ones the embedding cache misses (each distinct text
    once).

    `cache_model` names the model's version, and the tenant when caches are isolated.
    """
    cache = state.embedding_cache
    if cache is None:
        return await embedder.embed(texts), "MISS"
    found = await cache.get_many(cache_model, texts)
    missing = list(dict.fromkeys(t for t, v in zip(texts, found) if v is None))
    by_text = {}
    if missing:
        computed = await embedder.embed(missing)
        await cache.put_many(cache_model, missing, computed)
        by_text = dict(zip(missing, computed))
    vectors = [v if v is not None else by_text[t] for t, v in zip(texts, found)]
    return vectors, "MISS" if missing else "HIT"


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> Response:
    async def build(model: ModelInstance) -> JSONResponse:
        llm = model.text
        if (body.prompt is None) == (body.messages is None):
            raise InvalidRequestError("give exactly one of prompt or messages", "prompt")
        if body.messages is not None:
            messages = template_messages(body.messages, llm)
            tokens = await prompts.chat_prompt(llm, messages, body.add_generation_prompt, bos=False)
        else:
            assert body.prompt is not None  # exactly one of the two was given
            tokens = await prompts.off_loop(len(body.prompt), llm.tokenize, body.prompt)
        return JSONResponse(
            {"tokens": tokens, "count": len(tokens), "max_model_len": llm.max_model_len}
        )

    return await server_state(request).serve(body.model or None, "chat", build)


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> Response:
    async def build(model: ModelInstance) -> JSONResponse:
        llm = model.text
        if len(body.tokens) > llm.max_model_len:
            raise APIError(400, f"at most {llm.max_model_len} tokens", "tokens", "invalid_value")
        return JSONResponse({"prompt": llm.detokenize(body.tokens)})

    return await server_state(request).serve(body.model or None, "chat", build)
