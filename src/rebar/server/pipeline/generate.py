"""The generate stage: one admitted request on a chat model's engine, with the waiting-queue ticket,
token charging, disconnect-abort and the request's metrics and span; failures as pipeline errors.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from typing import TypeVar

from starlette.requests import Request

from rebar.engine.async_engine import EngineFront
from rebar.engine.outputs import Choice, OutputAccumulator, RequestOutput
from rebar.engine.request import AdmittedRequest
from rebar.obs.metrics import ServerMetrics
from rebar.obs.tracing import Tracing, end_generate_span
from rebar.server.pipeline.call import Call, Live, Outcome
from rebar.server.pipeline.errors import ClientGone, GenerationFailed, GenerationTimeout
from rebar.server.pipeline.gate import Pass
from rebar.server.pipeline.results import OUT_OF_TOKENS, Completion

DISCONNECT_POLL_S = 0.2
T = TypeVar("T")


async def run(call: Call) -> Outcome:
    """The last stage: a place in the waiting room (Overloaded, before any output, when it is
    full), then the engine; a whole answer collected, or the live stream."""
    state, model = call.state, call.model
    assert model is not None and call.prepared is not None and call.passed is not None
    admitted = call.prepared.admitted
    outputs = start(
        model.front,
        admitted,
        call.passed,
        state.metrics,
        state.tracing,
        call.context.internal_id,
        call.context.arrived_at,
        state.request_timeout_s,
    )
    if call.request.stream:
        return Outcome(live=stream(outputs, state.ping_interval_s))
    num_prompt_tokens = len(admitted.prompt_token_ids)
    watched = None if call.request.detached else call.http
    return Outcome(completion=await complete(watched, outputs, num_prompt_tokens))


def start(
    engine: EngineFront,
    admitted: AdmittedRequest,
    passed: Pass,
    metrics: ServerMetrics,
    tracing: Tracing,
    request_id: str,
    arrived_at: float | None,
    timeout_s: float,
) -> AsyncGenerator[RequestOutput, None]:
    """Stream engine outputs for `admitted` (checked at the front door: nothing here checks it
    again), once the request has a place in the waiting room (Overloaded, before any output, when
    it has none).

    Its ticket is released with the first output or the end. `arrived_at` (the HTTP arrival on the
    metrics clock) starts the request's TTFT and e2e timers. The pass's `spend` charges each
    output's new tokens to the client's tokens-per-minute limit as they come; when they no longer
    fit, every unfinished choice ends with reason OUT_OF_TOKENS (never cached, since the answer is
    cut) and the engine stops. The pass's tenant keeps the request's prefix-cache blocks apart from
    other tenants'.
    """
    ticket = passed.wait()
    spend, cache_salt = passed.spend, passed.tenant
    params = admitted.params
    timer = metrics.request_timer(arrived_at, params.n)
    span = tracing.tracer.start_span(
        "generate", attributes={"rebar.n": params.n, "rebar.max_tokens": params.max_tokens or 0}
    )

    async def outputs() -> AsyncGenerator[RequestOutput, None]:
        unfinished = set(range(params.n))
        try:
            async for output in engine.generate_admitted(
                admitted, request_id, timeout=timeout_s, cache_salt=cache_salt
            ):
                if not ticket.released:  # producing now: no longer waiting
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
            if not ticket.released:
                ticket.release()
            timer.close()
            end_generate_span(tracing.tracer, span, timer)

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
    request: Request | None, stream: AsyncGenerator[RequestOutput, None]
) -> OutputAccumulator:
    """Gather a whole response; if the client of `request` disconnects first, abort the
    generation."""
    collected = OutputAccumulator()

    async def consume() -> OutputAccumulator:
        async for output in stream:
            collected.add(output)
        return collected

    try:
        if request is None:
            return await consume()
        return await unless_disconnected(request, consume())
    finally:
        await stream.aclose()


async def complete(
    request: Request | None, outputs: AsyncGenerator[RequestOutput, None], num_prompt_tokens: int
) -> Completion:
    """The whole answer; raises when the client of `request` left (None: no client waits for it),
    the time limit passed or the engine failed."""
    completion = Completion.from_outputs(await collect(request, outputs), num_prompt_tokens)
    raise_for_failure(completion.choices)
    return completion


async def stream(outputs: AsyncGenerator[RequestOutput, None], ping_interval_s: float) -> Live:
    """A live stream: each output as it comes, None when `ping_interval_s` passes without one, and
    at the end the whole answer (when any choice produced output)."""
    collected = OutputAccumulator()
    async for output in with_pings(outputs, ping_interval_s):
        if output is not None:
            collected.add(output)
        yield output
    if collected.num_choices:
        yield Completion.from_outputs(collected, collected.num_prompt_tokens)


async def unless_disconnected(
    request: Request, work: Awaitable[T], timeout_s: float | None = None
) -> T:
    """The result of `work`, cancelled (ClientGone) if the client disconnects first or
    (GenerationTimeout) when `timeout_s` passes."""
    task = asyncio.ensure_future(work)
    loop = asyncio.get_running_loop()
    deadline = None if timeout_s is None else loop.time() + timeout_s
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientGone("client disconnected")
            if deadline is not None and loop.time() >= deadline:
                raise GenerationTimeout("the request exceeded its time limit")
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def with_pings(stream: AsyncGenerator[T, None], interval_s: float) -> AsyncIterator[T | None]:
    """Yield the stream's items, and None whenever `interval_s` passes without one (time for a
    ping).

    Closes `stream` when done or abandoned.
    """
    pending: asyncio.Future[T] | None = None
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


def raise_for_failure(choices: tuple[Choice, ...]) -> None:
    for choice in choices:
        if choice.finish_reason == "timeout":
            raise GenerationTimeout("the request exceeded its time limit")
        if choice.finish_reason == "error":
            raise GenerationFailed(choice.error or "generation failed")
