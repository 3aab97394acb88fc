"""Running one admitted request on the async engine for a route: the waiting-queue gate, token
charging, disconnect-abort, and failures as HTTP errors."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import TypeVar

from starlette.requests import Request

from rebar.engine.async_engine import EngineFront
from rebar.engine.outputs import Choice, OutputAccumulator, RequestOutput
from rebar.engine.request import AdmittedRequest
from rebar.obs.tracing import end_generate_span
from rebar.server.errors import APIError
from rebar.server.response_fields import OUT_OF_TOKENS
from rebar.server.state import ServerState

DISCONNECT_POLL_S = 0.2
T = TypeVar("T")

Spend = Callable[[int], Awaitable[bool]]  # charge generated tokens; False once they no longer fit


def start(
    state: ServerState,
    engine: EngineFront,
    admitted: AdmittedRequest,
    request_id: str,
    arrived_at: float | None = None,
    spend: Spend | None = None,
    cache_salt: str | None = None,
) -> AsyncGenerator[RequestOutput, None]:
    """Pass the admission gate (503 before any byte is sent) and stream engine outputs.

    `admitted` was checked at the route's front door; nothing here checks it again.
    `arrived_at` (the HTTP arrival on the metrics clock) starts the request's TTFT and e2e timers.
    `spend` charges each output's new tokens to the client's tokens-per-minute limit as they come;
    when they no longer fit, every unfinished choice ends with reason OUT_OF_TOKENS ("length" to the
    client; never cached, since the answer is cut) and the engine stops.
    `cache_salt` keeps the request's prefix-cache blocks apart from other tenants'.
    """
    params = admitted.params
    ticket = state.admission.admit(admitted.num_prompt_tokens)
    timer = state.metrics.request_timer(arrived_at, params.n)
    tracer = state.tracing.tracer
    span = tracer.start_span(
        "generate", attributes={"rebar.n": params.n, "rebar.max_tokens": params.max_tokens or 0}
    )

    async def outputs() -> AsyncGenerator[RequestOutput, None]:
        unfinished = set(range(params.n))
        try:
            async for output in engine.generate_admitted(
                admitted, request_id, timeout=state.request_timeout_s, cache_salt=cache_salt
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
    """The end of choice `index` when the client's tokens-per-minute budget ran out
    mid-generation."""
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


async def collect(
    request: Request, stream: AsyncGenerator[RequestOutput, None]
) -> OutputAccumulator:
    """Gather a whole response; if the client disconnects first, abort the generation."""
    collected = OutputAccumulator()

    async def consume() -> OutputAccumulator:
        async for output in stream:
            collected.add(output)
        return collected

    try:
        return await unless_disconnected(request, consume())
    finally:
        await stream.aclose()


async def unless_disconnected(
    request: Request, work: Awaitable[T], timeout_s: float | None = None
) -> T:
    """The result of `work`, cancelled (499) if the client disconnects first or (504) when
    `timeout_s` passes."""
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


def raise_for_failure(choices: tuple[Choice, ...]) -> None:
    for choice in choices:
        if choice.finish_reason == "timeout":
            raise APIError(504, "the request exceeded its time limit", code="timeout")
        if choice.finish_reason == "error":
            raise APIError(500, choice.error or "generation failed", code="internal_error")
