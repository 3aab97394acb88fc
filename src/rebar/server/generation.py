"""Running one request on the async engine for a route: admission, disconnect-abort, SSE with pings."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from starlette.requests import Request

from rebar.engine.async_engine import AsyncEngine
from rebar.engine.outputs import RequestOutput
from rebar.engine.sampling_params import SamplingParams
from rebar.obs.tracing import end_generate_span
from rebar.server.convert import ChoiceState, accumulate
from rebar.server.errors import APIError
from rebar.server.state import ServerState

PING = ": ping\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(data: dict | str) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {payload}\n\n"


async def start(state: ServerState, engine: AsyncEngine, prompt_ids: list[int], params: SamplingParams, request_id: str,
                arrived_at: float | None = None) -> AsyncIterator[RequestOutput]:
    """Validate (400 before any byte is sent), pass the admission gate, and stream engine outputs.

    `arrived_at` (the HTTP arrival on the metrics clock) starts the request's TTFT and e2e timers.
    """
    engine.core.check_request(prompt_ids, params)
    ticket = state.admission.admit(len(prompt_ids))
    timer = state.metrics.request_timer(arrived_at, params.n)
    tracer = state.tracing.tracer
    span = tracer.start_span("generate", attributes={"rebar.n": params.n, "rebar.max_tokens": params.max_tokens or 0})

    async def outputs() -> AsyncIterator[RequestOutput]:
        try:
            async for output in engine.generate(prompt_ids, params, request_id, timeout=state.request_timeout_s):
                ticket.release()
                timer.on_output(output)
                yield output
        finally:
            ticket.release()
            timer.close()
            end_generate_span(tracer, span, timer)

    return outputs()


async def collect(request: Request, stream: AsyncIterator[RequestOutput]) -> dict[int, ChoiceState]:
    """Gather a whole response; if the client disconnects first, abort the generation."""
    choices: dict[int, ChoiceState] = {}

    async def consume() -> None:
        async for output in stream:
            accumulate(choices, output)

    task = asyncio.create_task(consume())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.2)
            if done:
                task.result()
                return choices
            if await request.is_disconnected():
                task.cancel()
                raise APIError(499, "client disconnected")
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await stream.aclose()


def raise_for_failure(choices: dict[int, ChoiceState]) -> None:
    for choice in choices.values():
        if choice.finish_reason == "timeout":
            raise APIError(504, "the request exceeded its time limit", code="timeout")
        if choice.finish_reason == "error":
            raise APIError(500, f"generation failed: {choice.error}", code="internal_error")


async def with_pings(stream: AsyncIterator[RequestOutput], interval_s: float) -> AsyncIterator[RequestOutput | None]:
    """Yield the stream's items, and None whenever `interval_s` passes without one (time for a ping)."""
    pending: asyncio.Task | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(stream.__anext__())
            done, _ = await asyncio.wait({pending}, timeout=interval_s)
            if not done:
                yield None
                continue
            task, pending = pending, None
            try:
                yield task.result()
            except StopAsyncIteration:
                return
    finally:
        if pending is not None:
            pending.cancel()
            await asyncio.gather(pending, return_exceptions=True)
        await stream.aclose()


def stream_error(output: RequestOutput) -> str | None:
    """An SSE error event for a choice that ended by timeout or failure."""
    if output.finish_reason == "timeout":
        return sse({"error": {"message": "the request exceeded its time limit", "type": "timeout_error", "param": None, "code": "timeout"}})
    if output.finish_reason == "error":
        return sse({"error": {"message": f"generation failed: {output.error}", "type": "server_error", "param": None, "code": "internal_error"}})
    return None
