"""Running one request on the async engine for a route: admission, disconnect-abort, SSE with pings."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from starlette.requests import Request

from rebar.engine.async_engine import AsyncEngine
from rebar.engine.outputs import RequestOutput
from rebar.engine.sampling_params import SamplingParams
from rebar.obs.tracing import end_generate_span
from rebar.server.convert import OUT_OF_TOKENS, ChoiceState, accumulate
from rebar.server.errors import APIError
from rebar.server.state import ServerState

PING = ": ping\n\n"
DISCONNECT_POLL_S = 0.2
T = TypeVar("T")
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(data: dict | str) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {payload}\n\n"


Spend = Callable[[int], Awaitable[bool]]  # charge generated tokens; False once they no longer fit


async def start(
    state: ServerState,
    engine: AsyncEngine,
    prompt_ids: list[int],
    params: SamplingParams,
    request_id: str,
    arrived_at: float | None = None,
    spend: Spend | None = None,
    cache_salt: str | None = None,
) -> AsyncIterator[RequestOutput]:
    """Validate (400 before any byte is sent), pass the admission gate, and stream engine outputs.

    `arrived_at` (the HTTP arrival on the metrics clock) starts the request's TTFT and e2e timers.
    `spend` charges each output's new tokens to the client's tokens-per-minute limit as they come;
    when they no longer fit, every unfinished choice ends with reason OUT_OF_TOKENS ("length" to the
    client; never cached, since the answer is cut) and the engine stops.
    `cache_salt` keeps the request's prefix-cache blocks apart from other tenants'.
    """
    engine.core.check_request(prompt_ids, params)
    ticket = state.admission.admit(len(prompt_ids))
    timer = state.metrics.request_timer(arrived_at, params.n)
    tracer = state.tracing.tracer
    span = tracer.start_span(
        "generate", attributes={"rebar.n": params.n, "rebar.max_tokens": params.max_tokens or 0}
    )

    async def outputs() -> AsyncIterator[RequestOutput]:
        unfinished = set(range(params.n))
        try:
            async for output in engine.generate(
                prompt_ids,
                params,
                request_id,
                timeout=state.request_timeout_s,
                cache_salt=cache_salt,
            ):
                ticket.release()
                if (
                    spend is not None
                    and output.new_token_ids
                    and not await spend(len(output.new_token_ids))
                ):
                    for index in sorted(unfinished):  # leaving the loop aborts the engine request
                        cut = _out_of_tokens(output, index)
                        timer.on_output(cut)
                        yield cut
                    return
                if output.finished:
                    unfinished.discard(output.index)
                timer.on_output(output)
                yield output
        finally:
            ticket.release()
            timer.close()
            end_generate_span(tracer, span, timer)

    return outputs()


def _out_of_tokens(last: RequestOutput, index: int) -> RequestOutput:
    """The end of choice `index` when the client's tokens-per-minute budget ran out mid-generation."""
    return RequestOutput(
        last.request_id,
        index,
        (),
        "",
        finished=True,
        finish_reason=OUT_OF_TOKENS,
        num_prompt_tokens=last.num_prompt_tokens,
        num_cached_tokens=last.num_cached_tokens,
    )


async def collect(request: Request, stream: AsyncIterator[RequestOutput]) -> dict[int, ChoiceState]:
    """Gather a whole response; if the client disconnects first, abort the generation."""
    choices: dict[int, ChoiceState] = {}

    async def consume() -> dict[int, ChoiceState]:
        async for output in stream:
            accumulate(choices, output)
        return choices

    try:
        return await unless_disconnected(request, consume())
    finally:
        await stream.aclose()


async def unless_disconnected(
    request: Request, work: Awaitable[T], timeout_s: float | None = None
) -> T:
    """The result of `work`, cancelled (499) if the client disconnects first or (504) when `timeout_s` passes."""
    task = asyncio.ensure_future(work)
    loop = asyncio.get_running_loop()
    deadline = None if timeout_s is None else loop.time() + timeout_s
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise APIError(499, "client disconnected")
            if deadline is not None and loop.time() >= deadline:
                raise APIError(504, "the request exceeded its time limit", code="timeout")
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


def raise_for_failure(choices: dict[int, ChoiceState]) -> None:
    for choice in choices.values():
        if choice.finish_reason == "timeout":
            raise APIError(504, "the request exceeded its time limit", code="timeout")
        if choice.finish_reason == "error":
            raise APIError(500, choice.error or "generation failed", code="internal_error")


async def with_pings(
    stream: AsyncIterator[RequestOutput], interval_s: float
) -> AsyncIterator[RequestOutput | None]:
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
        return sse(
            {
                "error": {
                    "message": "the request exceeded its time limit",
                    "type": "timeout_error",
                    "param": None,
                    "code": "timeout",
                }
            }
        )
    if output.finish_reason == "error":
        return sse(
            {
                "error": {
                    "message": output.error or "generation failed",
                    "type": "server_error",
                    "param": None,
                    "code": "internal_error",
                }
            }
        )
    return None
