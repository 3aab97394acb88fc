"""Turning a generation into an HTTP response, shared by chat and completions.

A `Renderer` knows one endpoint's JSON and chunk shapes; `respond` runs the flow every generating
endpoint shares: cache lookup, generation (streamed or collected), write-through, token charging.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterator

from fastapi.responses import JSONResponse, Response
from starlette.requests import Request

from rebar.engine.async_engine import EngineFront
from rebar.engine.outputs import Choice, OutputAccumulator, RequestOutput
from rebar.engine.request import AdmittedRequest
from rebar.server import completion_flow as flow
from rebar.server import generation, sse
from rebar.server.completion_flow import Completion
from rebar.server.context import request_context
from rebar.server.response_cache import Lead
from rebar.server.response_fields import now, timing_fields, timing_header, usage
from rebar.server.state import ServerState


class Renderer:
    """One response's shapes. Subclasses give the JSON body and the chunks; the sequencing lives
    here."""

    object_name = ""

    def __init__(self, response_id: str, model: str) -> None:
        self.response_id, self.model, self.created = response_id, model, now()
        # The model version that produced the response (`system_fingerprint`), e.g. smollm2-v2.
        self.version = model

    def json(self, completion: Completion) -> dict:
        raise NotImplementedError

    def opening(self, n: int) -> Iterator[str]:
        """Chunks sent before any generated text (chat: the role; completions: an echoed prompt)."""
        return iter(())

    def output_chunks(self, output: RequestOutput) -> Iterator[str]:
        """Chunks for one engine output of a live stream."""
        raise NotImplementedError

    def replay_chunks(self, choice: Choice) -> Iterator[str]:
        """Chunks for one whole cached choice."""
        raise NotImplementedError

    def chunk(self, choices: list[dict], **extra) -> str:
        return sse.event(
            {
                "id": self.response_id,
                "object": self.object_name,
                "created": self.created,
                "model": self.model,
                "system_fingerprint": self.version,
                "choices": choices,
                **extra,
            }
        )

    def _usage_chunk(self, completion: Completion, num_cached: int) -> str:
        # A stream's headers leave before its timing is known: the usage chunk carries it instead.
        extra = (
            {}
            if completion.timing is None
            else {"timing": timing_fields(completion.timing, num_cached)}
        )
        return self.chunk(
            [],
            usage=usage(completion.num_prompt_tokens, completion.num_completion_tokens, num_cached),
            **extra,
        )

    async def replay(self, completion: Completion, include_usage: bool) -> AsyncIterator[str]:
        """A cached answer as the same SSE sequence a fresh one produces."""
        for event in self.opening(len(completion.choices)):
            yield event
        for choice in completion.choices:
            for event in self.replay_chunks(choice):
                yield event
        if include_usage:
            yield self._usage_chunk(completion, completion.num_cached_tokens)
        yield sse.DONE

    async def stream(
        self,
        outputs: AsyncGenerator[RequestOutput, None],
        n: int,
        include_usage: bool,
        ping_interval_s: float,
        lead: Lead | None,
        on_done: Callable[[Completion], Awaitable[None]],
    ) -> AsyncIterator[str]:
        collected = OutputAccumulator()
        completion, last = None, None
        try:
            for event in self.opening(n):
                yield event
            async for output in sse.with_pings(outputs, ping_interval_s):
                if output is None:
                    yield sse.PING
                    continue
                last = output
                collected.add(output)
                for event in self.output_chunks(output):
                    yield event
            completion = Completion.from_outputs(collected, collected.num_prompt_tokens)
            if include_usage and last is not None:
                yield self._usage_chunk(completion, last.num_cached_tokens)
            yield sse.DONE
        finally:
            whole = completion is not None and collected.num_choices == n
            await flow.finish_lead(lead, completion if whole else None)
            if completion is not None:
                await on_done(completion)


async def respond(
    state: ServerState,
    request: Request,
    engine: EngineFront,
    render: Renderer,
    endpoint: str,
    admitted: AdmittedRequest,
    stream: bool,
    include_usage: bool,
) -> Response:
    """Rate-limit, serve from the cache or generate, and write the answer through.

    `admitted` passed the route's front door; nothing here checks it again.
    """
    prompt_ids = list(admitted.prompt_token_ids)
    params = admitted.params
    headers = await flow.check_rate_limit(state, request, len(prompt_ids))
    tenant = flow.tenant(state, request)
    canonical = flow.canonical_request(
        endpoint, prompt_ids, params, {"tenant": tenant} if tenant else None
    )
    # Keyed by version: a reloaded model never replays an older version's answers.
    cached, lead, cache_header = await flow.cache_lookup(
        state, request, render.version, canonical, params
    )
    if cache_header:
        headers["X-Cache"] = cache_header
    if cached is not None:
        completion = Completion.from_json(cached, len(prompt_ids))
        note_for_access_log(state, request, engine, prompt_ids, completion)
        if stream:
            return sse.response(render.replay(completion, include_usage), headers)
        return JSONResponse(render.json(completion), headers=headers)

    outputs = await _start(state, request, engine, admitted, lead, tenant)

    async def on_done(completion: Completion) -> None:
        note_for_access_log(state, request, engine, prompt_ids, completion)

    if stream:
        events = render.stream(
            outputs, params.n, include_usage, state.ping_interval_s, lead, on_done
        )
        return sse.response(events, headers)
    completion = await _collect(request, outputs, len(prompt_ids), lead)
    await on_done(completion)
    headers["x-rebar-timing"] = timing_header(
        timing_fields(completion.timing, completion.num_cached_tokens)
    )
    return JSONResponse(render.json(completion), headers=headers)


async def _start(
    state: ServerState,
    request: Request,
    engine: EngineFront,
    admitted: AdmittedRequest,
    lead: Lead | None,
    tenant: str | None,
) -> AsyncGenerator[RequestOutput, None]:
    """The request's outputs from the engine; a failure to start releases the cache lead."""
    context = request_context(request.scope)
    try:
        return generation.start(
            state,
            engine,
            admitted,
            context.internal_id,
            context.arrived_at,
            flow.token_spender(state, request),
            cache_salt=tenant,
        )
    except BaseException:
        await flow.finish_lead(lead, None)
        raise


async def _collect(
    request: Request,
    outputs: AsyncGenerator[RequestOutput, None],
    num_prompt_tokens: int,
    lead: Lead | None,
) -> Completion:
    """The whole answer, written through to the cache lead; a failed one releases the lead."""
    try:
        completion = Completion.from_outputs(
            await generation.collect(request, outputs), num_prompt_tokens
        )
        generation.raise_for_failure(completion.choices)
    except BaseException:
        await flow.finish_lead(lead, None)
        raise
    await flow.finish_lead(lead, completion)
    return completion


def note_for_access_log(
    state: ServerState,
    request: Request,
    engine: EngineFront,
    prompt_ids: list[int],
    completion: Completion,
) -> None:
    """Token counts (and, only when `log_prompts` is on, the texts) for this request's access-log
    line."""
    fields = {
        "prompt_tokens": completion.num_prompt_tokens,
        "completion_tokens": completion.num_completion_tokens,
        **timing_fields(completion.timing, completion.num_cached_tokens),
    }
    if state.log_prompts:
        fields["prompt"] = engine.tokenizer.decode(prompt_ids, skip_special_tokens=False)
        fields["completions"] = [choice.text for choice in completion.choices]
    request_context(request.scope).log.update(fields)
