"""Anthropic's Messages API: `POST /v1/messages` (whole or streamed) and
`POST /v1/messages/count_tokens`. What each field does: docs/anthropic.md."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from rebar.server.dialects.anthropic_messages.errors import ERRORS
from rebar.server.dialects.anthropic_messages.render import MessagesRenderer
from rebar.server.dialects.anthropic_messages.schemas import (
    CountTokensRequest,
    MessagesRequest,
    conversation,
    tools,
)
from rebar.server.pipeline.lease import with_chat_model
from rebar.server.pipeline.prepare import conversation_prompt
from rebar.server.pipeline.request import GenerationRequest, SamplingParams, StructuredOutput
from rebar.server.pipeline.respond import respond
from rebar.server.state import server_state
from rebar.serving.instances import ChatModel

__all__ = ["ERRORS", "PREFIX", "router"]

PREFIX = "/v1/messages"  # every path of this dialect, for its error shape
router = APIRouter()


@router.post("/v1/messages")
async def create_message(body: MessagesRequest, request: Request) -> Response:
    return await respond(server_state(request), request, neutral(body), MessagesRenderer)


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, request: Request) -> Response:
    """The prompt's tokens as `/v1/messages` would count them for the same conversation and
    tools (its `usage.input_tokens` plus `cache_read_input_tokens`)."""
    question = GenerationRequest(
        model=body.model,
        params=SamplingParams(),
        endpoint="messages",
        messages=conversation(body),
        tools=tools(body),
    )

    async def answer(model: ChatModel) -> Response:
        ids, _ = await conversation_prompt(model.text, question)
        return JSONResponse({"input_tokens": len(ids)})

    return await with_chat_model(server_state(request), body.model, answer)


def neutral(body: MessagesRequest) -> GenerationRequest:
    """The body as the pipeline's request; raises InvalidRequestError naming the parameter."""
    fmt = body.output_config.format if body.output_config else None
    structured = (
        None
        if fmt is None
        else StructuredOutput.json_schema(
            fmt.schema_, strict=True, param="output_config.format.schema"
        )
    )
    params = SamplingParams(
        max_tokens=body.max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k or 0,
        stop=tuple(body.stop_sequences or ()),
        structured=structured,
    )
    return GenerationRequest(
        model=body.model,
        params=params,
        endpoint="messages",
        messages=conversation(body),
        tools=tools(body),
        stream=body.stream,
    )
