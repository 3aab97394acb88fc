"""OpenAI's Responses API: `POST /v1/responses` (whole, streamed or in the background), and the
stored responses: `GET` and `DELETE /v1/responses/{id}`, `GET /v1/responses/{id}/input_items`,
`POST /v1/responses/{id}/cancel`. What each field does: docs/responses.md."""

from __future__ import annotations

import asyncio
import time
from typing import Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response

from rebar.errors import InvalidRequestError
from rebar.server.context import request_context
from rebar.server.conversations import ResponseStore
from rebar.server.dialects.openai_responses.flow_http import (
    Stored,
    respond_flow,
    run_detached,
    tool_flow,
)
from rebar.server.dialects.openai_responses.mcp_tools import has_mcp
from rebar.server.dialects.openai_responses.render import ResponsesRenderer, new_id
from rebar.server.dialects.openai_responses.schemas import (
    LOGPROBS,
    McpChoice,
    ResponsesRequest,
    TextFormat,
    conversation,
    function_tools,
)
from rebar.server.errors import APIError, problem_of
from rebar.server.pipeline.request import (
    GenerationRequest,
    Message,
    SamplingParams,
    StructuredOutput,
    Tools,
)
from rebar.server.pipeline.respond import produce, respond
from rebar.server.state import ServerState, server_state

router = APIRouter()
TERMINAL = frozenset({"completed", "incomplete", "failed", "cancelled"})
CANCEL_POLL_S = 0.05


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, request: Request) -> Response:
    state = server_state(request)
    tenant = request_context(request.scope).api_key_id
    history = await _history(state.responses, tenant, body.previous_response_id)
    inputs = _with_ids(body.input)
    neutral = GenerationRequest(
        model=body.model,
        params=_params(body),
        endpoint="responses",
        messages=tuple(_messages(body, history, inputs)),
        tools=_tools(body),
        stream=body.stream,
        detached=body.background,
    )
    response_id = new_id("resp")
    shell = _shell(body)

    async def finished(final: dict[str, Any]) -> None:
        if body.store:
            record = {"response": final, "input": inputs, "history": history}
            await state.responses.put(tenant, record)

    def renderer(info):
        return ResponsesRenderer(info, response_id, shell, finished)

    if body.background:
        _check_background(body)
    flow = None
    if has_mcp(body.tools):
        flow = await tool_flow(state, request, body, neutral, response_id, shell, finished)
    if not body.background:
        if flow is not None:
            return await respond_flow(request, *flow, body.stream)
        return await respond(state, request, neutral, renderer)
    queued = {"response": _queued(response_id, shell), "input": inputs, "history": history}
    await state.responses.put(tenant, queued)
    work = (
        run_detached(state, *flow, Stored(tenant, queued))
        if flow is not None
        else _run_detached(state, request, neutral, renderer, tenant, queued)
    )
    state.background.start(response_id, work)
    return JSONResponse(queued["response"])


def _check_background(body: ResponsesRequest) -> None:
    if not body.store:
        raise InvalidRequestError("background responses are stored: give store true", "store")
    if body.stream:
        raise InvalidRequestError("background responses cannot be streamed", "stream")


async def _run_detached(
    state: ServerState,
    request: Request,
    neutral: GenerationRequest,
    renderer: Any,
    tenant: str | None,
    record: dict[str, Any],
) -> None:
    """A background response: generated to its end, or cancelled, or failed; stored either way."""
    response = record["response"]
    await state.responses.put(tenant, {**record, "response": {**response, "status": "in_progress"}})
    try:
        outcome, info = await produce(state, request, neutral)
        render = renderer(info)
        assert outcome.answer is not None, "a detached request is answered whole"
        render.body(outcome.answer)
        await render.done()
    except asyncio.CancelledError:
        cancelled = {**response, "status": "cancelled"}
        await asyncio.shield(state.responses.put(tenant, {**record, "response": cancelled}))
        raise
    except Exception as exc:
        problem = problem_of(exc)
        error = {"code": problem.code or "server_error", "message": problem.message}
        failed = {**response, "status": "failed", "error": error}
        await state.responses.put(tenant, {**record, "response": failed})


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, request: Request) -> dict[str, Any]:
    return (await _record(request, response_id))["response"]


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request) -> dict[str, Any]:
    state = server_state(request)
    tenant = request_context(request.scope).api_key_id
    if not await state.responses.delete(tenant, response_id):
        raise _not_found(response_id)
    return {"id": response_id, "object": "response", "deleted": True}


@router.get("/v1/responses/{response_id}/input_items")
async def input_items(
    response_id: str,
    request: Request,
    after: str | None = None,
    limit: int = Query(20, ge=1, le=100),
    order: Literal["asc", "desc"] = "desc",
) -> dict[str, Any]:
    items = list((await _record(request, response_id))["input"])
    if order == "desc":
        items.reverse()
    ids = [item["id"] for item in items]
    if after is not None:
        if after not in ids:
            raise InvalidRequestError(f"no input item {after!r} in this response", "after")
        items = items[ids.index(after) + 1 :]
    page = items[:limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(items) > limit,
    }


@router.post("/v1/responses/{response_id}/cancel")
async def cancel_response(response_id: str, request: Request) -> dict[str, Any]:
    """Cancel a background response wherever it runs (its engine request aborted, its KV blocks
    freed) and answer with it as stored once cancelled; a finished one is answered as it is."""
    state = server_state(request)
    tenant = request_context(request.scope).api_key_id
    response = (await _record(request, response_id))["response"]
    if not response.get("background"):
        raise InvalidRequestError("only background responses can be cancelled", "response_id")
    if response["status"] in TERMINAL:
        return response
    await state.background.cancel(response_id)
    deadline = time.monotonic() + state.cancel_wait_s
    while time.monotonic() < deadline:
        record = await state.responses.get(tenant, response_id)
        if record is not None and record["response"]["status"] in TERMINAL:
            return record["response"]
        await asyncio.sleep(CANCEL_POLL_S)
    return {**response, "status": "cancelling"}


# ----- the request -----------------------------------------------------------------------


def _params(body: ResponsesRequest) -> SamplingParams:
    with_logprobs = LOGPROBS in (body.include or ())
    if body.top_logprobs and not with_logprobs:
        raise InvalidRequestError(f"top_logprobs needs include [{LOGPROBS!r}]", "top_logprobs")
    text_format = body.text.format if body.text else None
    return SamplingParams(
        max_tokens=body.max_output_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        min_p=body.min_p,
        seed=body.seed,
        ignore_eos=body.ignore_eos,
        logprobs=(body.top_logprobs or 0) if with_logprobs else None,
        structured=_structured(text_format),
    )


def _structured(fmt: TextFormat | None) -> StructuredOutput | None:
    """What `text.format` asks the output to be (None: free text). Objects are closed unless the
    client says strict: false, as in chat."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutput.json_object(param="text.format")
    schema = fmt.schema_ if fmt.schema_ is not None else {"type": "object"}
    return StructuredOutput.json_schema(
        schema, strict=fmt.strict is not False, param="text.format.schema"
    )


def _tools(body: ResponsesRequest) -> Tools | None:
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise InvalidRequestError("tool_choice needs tools to choose from", "tool_choice")
        return None
    functions = function_tools(body.tools)
    parallel = body.parallel_tool_calls is not False
    if isinstance(choice, str) or choice is None:
        return Tools(functions, choice or "auto", None, parallel)
    if isinstance(choice, McpChoice):
        if not any(t.get("server_label") == choice.server_label for t in body.tools):
            raise InvalidRequestError(
                f"tool_choice names server_label {choice.server_label!r}, not among the tools",
                "tool_choice",
            )
        return Tools(functions, "auto", choice.name, parallel)
    return Tools(functions, "auto", choice.name, parallel)


def _messages(
    body: ResponsesRequest, history: list[dict[str, Any]], inputs: list[dict[str, Any]]
) -> list[Message]:
    """The instructions (this request's: earlier ones are not carried over), the conversation so
    far, then this request's input."""
    lead = [Message("system", body.instructions, "instructions")] if body.instructions else []
    return lead + conversation(history, "previous_response_id") + conversation(inputs)


def _with_ids(given: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The input as items with ids (as `input_items` lists them); a string is one user message."""
    if isinstance(given, str):
        part = {"type": "input_text", "text": given}
        given = [{"type": "message", "role": "user", "content": [part]}]
    prefixes = {"function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}
    return [
        {**item, "id": item.get("id") or new_id(prefixes.get(item.get("type", ""), "msg"))}
        for item in given
    ]


def _shell(body: ResponsesRequest) -> dict[str, Any]:
    """The request's fields a response object repeats."""
    fmt = body.text.format if body.text and body.text.format else None
    return {
        "model": body.model,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "tools": body.tools or [],
        "tool_choice": _choice(body),
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "max_tool_calls": body.max_tool_calls,
        "text": {
            "format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}
        },
        "reasoning": body.reasoning.model_dump(exclude_none=True) if body.reasoning else None,
        "previous_response_id": body.previous_response_id,
        "store": body.store,
        "background": body.background,
        "metadata": body.metadata or {},
        "user": body.user,
        "truncation": "disabled",
        "top_logprobs": body.top_logprobs,
    }


def _choice(body: ResponsesRequest) -> Any:
    choice = body.tool_choice
    if choice is None:
        return "auto"
    return choice if isinstance(choice, str) else choice.model_dump()


def _queued(response_id: str, shell: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),
        "status": "queued",
        "error": None,
        "incomplete_details": None,
        "output": [],
        "usage": None,
        **shell,
    }


# ----- stored responses ------------------------------------------------------------------


async def _history(
    store: ResponseStore, tenant: str | None, previous: str | None
) -> list[dict[str, Any]]:
    """The items of the conversation a `previous_response_id` continues."""
    if previous is None:
        return []
    record = await store.get(tenant, previous)
    if record is None:
        raise APIError(
            404, f"previous response {previous!r} not found", "previous_response_id", "not_found"
        )
    return [*record["history"], *record["input"], *record["response"]["output"]]


async def _record(request: Request, response_id: str) -> dict[str, Any]:
    state = server_state(request)
    record = await state.responses.get(request_context(request.scope).api_key_id, response_id)
    if record is None:
        raise _not_found(response_id)
    return record


def _not_found(response_id: str) -> APIError:
    return APIError(404, f"response {response_id!r} not found", "response_id", "not_found")
