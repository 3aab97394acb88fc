"""A response whose tools include MCP servers, over HTTP: its tool loop (`flow.Flow`) streamed to
the client, collected into one body, or run in the background (stored as it ends, cancelled or
not). The client leaving a foreground response cancels its loop."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, replace
from typing import Any

from fastapi.responses import JSONResponse, Response
from starlette.requests import Request

from rebar.server import sse
from rebar.server.context import request_context
from rebar.server.dialects.openai_responses.flow import Flow
from rebar.server.dialects.openai_responses.flow_render import FlowRenderer
from rebar.server.dialects.openai_responses.mcp_tools import mcp_tools, open_toolbox
from rebar.server.dialects.openai_responses.render import Finished
from rebar.server.dialects.openai_responses.schemas import ResponsesRequest
from rebar.server.pipeline.generate import unless_disconnected
from rebar.server.pipeline.request import GenerationRequest, Tools
from rebar.server.pipeline.respond import ResponseInfo
from rebar.server.state import ServerState


@dataclass
class Stored:
    """Where a background response is kept: its tenant and its record (queued)."""

    tenant: str | None
    record: dict[str, Any]


async def tool_flow(
    state: ServerState,
    http: Request,
    body: ResponsesRequest,
    neutral: GenerationRequest,
    response_id: str,
    shell: dict[str, Any],
    finished: Finished,
) -> tuple[Flow, FlowRenderer]:
    """The response's loop, its MCP servers connected and listed (a 400 for a server not
    allowed, a 424 for one that cannot be listed)."""
    assert state.tool_loop is not None and body.tools is not None
    servers = state.tool_loop.servers
    tools = neutral.tools or Tools(())
    requested = mcp_tools(body.tools, servers)
    toolbox = await open_toolbox(requested, servers, {f.name for f in tools.functions})
    tools = replace(tools, functions=(*tools.functions, *toolbox.functions))
    context = request_context(http.scope)
    info = ResponseInfo(context.internal_id, body.model, "", int(time.time()), 1, False, False)
    labels = {name: route[0] for name, route in toolbox.routes.items()}
    render = FlowRenderer(info, response_id, shell, finished, labels=labels)
    limit = body.max_tool_calls or state.tool_loop.limits.max_tool_calls
    flow = Flow(state, http, replace(neutral, tools=tools), toolbox, render, limit)
    return flow, render


async def respond_flow(http: Request, flow: Flow, render: FlowRenderer, stream: bool) -> Response:
    """A foreground response: streamed, or whole once the loop ended."""
    if stream:
        return sse.response(_streamed(flow, render, http), {})
    await unless_disconnected(http, _drain(flow))
    await render.done()
    assert render.final is not None, "a finished loop rendered its response"
    return JSONResponse(render.final)


async def run_detached(
    state: ServerState, flow: Flow, render: FlowRenderer, stored: Stored
) -> None:
    """A background loop to its end, stored; cancelled, it is stored with what it had done."""
    record, tenant = stored.record, stored.tenant
    running = {**record["response"], "status": "in_progress"}
    await state.responses.put(tenant, {**record, "response": running})
    try:
        await _drain(flow)
        await render.done()
    except asyncio.CancelledError:
        cancelled = render.response("cancelled", output=render.output)
        await asyncio.shield(state.responses.put(tenant, {**record, "response": cancelled}))
        raise


async def _drain(flow: Flow) -> None:
    async for _ in flow.events():
        pass


async def _streamed(flow: Flow, render: FlowRenderer, http: Request):
    try:
        async for text in flow.events(http.is_disconnected):
            yield text
    finally:
        await render.done()
