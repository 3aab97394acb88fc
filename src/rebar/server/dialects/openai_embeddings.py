"""OpenAI embeddings: `POST /v1/embeddings`, texts or token ids in, vectors out (floats or
base64)."""

from __future__ import annotations

import base64
from typing import Any, cast

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import Response

from rebar.server.dialects.openai_schemas import EmbeddingRequest as Body
from rebar.server.pipeline.embed import Embeddings, embed_response
from rebar.server.pipeline.request import EmbeddingRequest
from rebar.server.state import server_state

router = APIRouter()


@router.post("/v1/embeddings")
async def embeddings(body: Body, request: Request) -> Response:
    neutral = EmbeddingRequest(
        body.model, _inputs(body.input), body.dimensions, body.truncate_prompt_tokens
    )

    def render(result: Embeddings) -> dict[str, Any]:
        return _body(result, body.encoding_format)

    return await embed_response(server_state(request), request, neutral, render)


def _inputs(
    given: str | list[str] | list[int] | list[list[int]],
) -> tuple[str | tuple[int, ...], ...]:
    """A text, texts, one list of token ids, or several."""
    if isinstance(given, str):
        return (given,)
    if given and all(isinstance(item, int) for item in given):
        return (tuple(cast(list[int], given)),)
    return tuple(
        item if isinstance(item, str) else tuple(item)
        for item in cast(list[str] | list[list[int]], given)
    )


def _body(result: Embeddings, encoding_format: str) -> dict[str, Any]:
    data = []
    for index, vector in enumerate(result.vectors):
        values = np.asarray(vector, dtype=np.float32)
        encoded = (
            base64.b64encode(values.tobytes()).decode()
            if encoding_format == "base64"
            else values.tolist()
        )
        data.append({"object": "embedding", "index": index, "embedding": encoded})
    usage = {"prompt_tokens": result.num_tokens, "total_tokens": result.num_tokens}
    return {"object": "list", "data": data, "model": result.model, "usage": usage}
