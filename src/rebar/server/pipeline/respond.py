"""The pipeline for a generation: a dialect's neutral request goes down through the stages — lease
the model's version (`lease`), build the prompt (`prepare`), pass the gate (`gate`), the response
cache (`cache`), generate (`generate`) — and its answer comes back up through each of them to the
dialect's renderer, which turns it into the HTTP response.

Each stage is `run(call, next)` and calls the next itself, so the request passes through every
stage once on the way down and once on the way up (`rebar.server.pipeline.call`). Dialects render
through a `Renderer` they build from `ResponseInfo`: a whole answer as a JSON body, or a stream as
text events, one call per neutral item, pushed in order by the pipeline (which owns the stream: it
closes the engine request when the client leaves).
"""

from __future__ import annotations

import functools
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from fastapi.responses import JSONResponse, Response
from starlette.requests import Request

from rebar.server import sse
from rebar.server.context import request_context
from rebar.server.pipeline import cache, gate, generate, lease, prepare
from rebar.server.pipeline.call import Call, Next, Outcome
from rebar.server.pipeline.request import GenerationRequest
from rebar.server.pipeline.results import Answer, StreamItem
from rebar.server.state import ServerState


@dataclass(frozen=True)
class ResponseInfo:
    """What a renderer knows of the response it renders. `id` is rebar's own id for the request
    (dialects prefix it); `model` is the name the client asked for, `version` the model version
    that answers (e.g. smollm2-v2)."""

    id: str
    model: str
    version: str
    created: int
    n: int
    include_usage: bool
    thinking: bool  # the model writes reasoning apart from its content
    echo_text: str = ""
    num_prompt_tokens: int = 0


class Renderer(Protocol):
    def body(self, answer: Answer) -> dict[str, Any]:
        """A whole answer as the dialect's JSON body."""
        ...

    def stream_start(self) -> Iterable[str]:
        """Events before any generated text."""
        ...

    def stream_item(self, item: StreamItem) -> Iterable[str]:
        """Events for one item of the stream (a keep-alive, what one output added, the end)."""
        ...

    def stream_end(self) -> Iterable[str]:
        """Events after the last item (also after a stream that produced no output)."""
        ...

    async def done(self) -> None:
        """Called once the answer has been rendered whole, or its stream has ended however it
        ended (a dialect that keeps answers stores them here)."""
        ...


MakeRenderer = Callable[[ResponseInfo], Renderer]


def _chain(*stages: Callable[..., Any]) -> Next:
    """The stages as one callable, each handed the next (the last one is handed none)."""
    *outer, last = stages
    chained: Next = last
    for stage in reversed(outer):
        chained = functools.partial(stage, next=chained)
    return chained


STAGES: Next = _chain(lease.run, prepare.run, gate.run, cache.run, generate.run)


async def respond(
    state: ServerState, http: Request, request: GenerationRequest, renderer: MakeRenderer
) -> Response:
    """The response to `request`, rendered by the dialect's `renderer`."""
    outcome, info = await produce(state, http, request)
    render = renderer(info)
    if outcome.items is not None:
        return sse.response(_sse(render, outcome.items), outcome.headers)
    answer = outcome.answer
    assert answer is not None, "the prepare stage read the answer"
    headers = dict(outcome.headers)
    if answer.timing is not None:  # a cache hit computed nothing
        headers["x-rebar-timing"] = timing_header(answer.timing)
    body = render.body(answer)
    await render.done()
    return JSONResponse(body, headers=headers)


async def produce(
    state: ServerState, http: Request, request: GenerationRequest
) -> tuple[Outcome, ResponseInfo]:
    """`request` run through the stages: its outcome (a whole answer or stream items, and the
    stages' headers) and what a renderer knows of it."""
    context = request_context(http.scope)
    call = Call(state, http, request, context)
    outcome = await STAGES(call)
    assert call.model is not None and call.prepared is not None, "the stages ran"
    info = ResponseInfo(
        context.internal_id,
        request.model or call.model.entry.name,
        call.model.label,
        int(time.time()),
        call.prepared.admitted.params.n,
        request.include_usage,
        call.prepared.reader.thinking is not None,
        call.prepared.echo_text,
        len(call.prepared.admitted.prompt_token_ids),
    )
    return outcome, info


async def _sse(render: Renderer, items: AsyncGenerator[StreamItem, None]) -> AsyncIterator[str]:
    try:
        for text in render.stream_start():
            yield text
        async for item in items:
            for text in render.stream_item(item):
                yield text
        for text in render.stream_end():
            yield text
    finally:
        try:
            await items.aclose()
        finally:
            await render.done()


def timing_header(fields: dict[str, Any]) -> str:
    """`x-rebar-timing: queue_ms=1.2, prefill_ms=30.5, decode_ms=410.0, cached_prompt_tokens=0,
    draft_tokens=40, accepted_draft_tokens=31`."""
    return ", ".join(f"{key}={value}" for key, value in fields.items())
