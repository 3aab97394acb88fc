"""`POST /tokenize` and `POST /detokenize` (vLLM's extension): a chat model's tokenizer and chat
template, without generating."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from rebar.errors import InvalidRequestError
from rebar.server.dialects.openai_schemas import (
    DetokenizeRequest,
    TokenizeRequest,
    neutral_messages,
)
from rebar.server.pipeline.lease import with_chat_model
from rebar.server.pipeline.prepare import chat_prompt, off_loop, template_messages
from rebar.server.state import server_state
from rebar.serving.instances import ChatModel

router = APIRouter()


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> Response:
    if (body.prompt is None) == (body.messages is None):
        raise InvalidRequestError("give exactly one of prompt or messages", "prompt")

    async def answer(model: ChatModel) -> JSONResponse:
        text = model.text
        if body.messages is not None:
            messages = template_messages(neutral_messages(body.messages), text)
            tokens = await chat_prompt(text, messages, body.add_generation_prompt, bos=False)
        else:
            assert body.prompt is not None  # exactly one of the two was given
            tokens = await off_loop(len(body.prompt), text.tokenize, body.prompt)
        return JSONResponse(
            {"tokens": tokens, "count": len(tokens), "max_model_len": text.max_model_len}
        )

    return await with_chat_model(server_state(request), body.model or None, answer)


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> Response:
    async def answer(model: ChatModel) -> JSONResponse:
        text = model.text
        if len(body.tokens) > text.max_model_len:
            raise InvalidRequestError(f"at most {text.max_model_len} tokens", "tokens")
        return JSONResponse({"prompt": text.detokenize(body.tokens)})

    return await with_chat_model(server_state(request), body.model or None, answer)
