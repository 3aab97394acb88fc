"""OpenAI embeddings: `POST /v1/embeddings`, texts in, vectors out (floats or base64)."""

from __future__ import annotations

import base64
from typing import Any

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
        body.model,
        (body.input,) if isinstance(body.input, str) else tuple(body.input),
        body.dimensions,
    )

    def render(result: Embeddings) -> dict[str, Any]:
        return _body(result, body.encoding_format)

    return await embed_response(server_state(request), request, neutral, render)


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
