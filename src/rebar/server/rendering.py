"""Turning a generation into an HTTP response, shared by chat and completions.

A `Renderer` knows one endpoint's JSON and chunk shapes; `respond` runs the flow every generating
endpoint shares: cache lookup, generation (streamed or collected), write-through, token charging.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import Request

from rebar.engine.async_engine import AsyncEngine
from rebar.engine.outputs import RequestOutput
from rebar.engine.sampling_params import SamplingParams
from rebar.server import completion_flow as flow
from rebar.server import generation
from rebar.server.completion_flow import ChoiceResult, Completion
from rebar.server.convert import ChoiceState, accumulate, now, timing_fields, timing_header, usage
from rebar.server.response_cache import Lead
from rebar.server.state import ServerState


class Renderer:
    """One response's shapes. Subclasses give the JSON body and the chunks; the sequencing lives here."""

    object_name = ""

    def __init__(self, response_id: str, model: str) -> None:
        self.response_id, self.model, self.created = response_id, model, now()

    def json(self, completion: Completion) -> dict:
        raise NotImplementedError

    def opening(self, n: int) -> Iterator[str]:
        """Chunks sent before any generated text (chat: the role; completions: an echoed prompt)."""
        return iter(())

    def output_chunks(self, output: RequestOutput) -> Iterator[str]:
        """Chunks for one engine output of a live stream."""
        raise NotImplementedError

    def replay_chunks(self, choice: ChoiceResult) -> Iterator[str]:
        """Chunks for one whole cached choice."""
        raise NotImplementedError

    def chunk(self, choices: list[dict], **extra) -> str:
        return generation.sse(
            {
                "id": self.response_id,
                "object": self.object_name,
                "created": self.created,
                "model": self.model,
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
        yield generation.sse("[DONE]")

    async def stream(
        self,
        outputs: AsyncIterator[RequestOutput],
        n: int,
        include_usage: bool,
        ping_interval_s: float,
        lead: Lead | None,
        on_done: Callable[[Completion], Awaitable[None]],
    ) -> AsyncIterator[str]:
        choices: dict[int, ChoiceState] = {}
        completion, last = None, None
        try:
            for event in self.opening(n):
                yield event
            async for output in generation.with_pings(outputs, ping_interval_s):
                if output is None:
                    yield generation.PING
                    continue
                last = output
                accumulate(choices, output)
                for event in self.output_chunks(output):
                    yield event
            completion = Completion.from_states(choices, last.num_prompt_tokens if last else 0)
            if include_usage and last is not None:
                yield self._usage_chunk(completion, last.num_cached_tokens)
            yield generation.sse("[DONE]")
        finally:
            await flow.finish_lead(lead, completion if completion and len(choices) == n else None)
            if completion is not None:
                await on_done(completion)


async def respond(
    state: ServerState,
    request: Request,
    engine: AsyncEngine,
    render: Renderer,
    endpoint: str,
    prompt_ids: list[int],
    params: SamplingParams,
    stream: bool,
    include_usage: bool,
):
    """Validate, rate-limit, serve from the cache or generate, and write the answer through."""
    engine.core.check_request(prompt_ids, params)
    headers = await flow.check_rate_limit(state, request, len(prompt_ids))
    tenant = flow.tenant(state, request)
    canonical = flow.canonical_request(
        endpoint, prompt_ids, params, {"tenant": tenant} if tenant else None
    )
    cached, lead, cache_header = await flow.cache_lookup(
        state, request, render.model, canonical, params
    )
    if cache_header:
        headers["X-Cache"] = cache_header
    if cached is not None:
        completion = Completion.from_json(cached, len(prompt_ids))
        note_for_access_log(state, request, engine, prompt_ids, completion)
        if stream:
            return StreamingResponse(
                render.replay(completion, include_usage),
                media_type="text/event-stream",
                headers={**generation.SSE_HEADERS, **headers},
            )
        return JSONResponse(render.json(completion), headers=headers)

    try:
        outputs = await generation.start(
            state,
            engine,
            prompt_ids,
            params,
            request.scope["state"]["internal_id"],
            request.scope["state"].get("arrived_at"),
            flow.token_spender(state, request),
            cache_salt=tenant,
        )
    except BaseException:
        await flow.finish_lead(lead, None)
        raise

    async def on_done(completion: Completion) -> None:
        note_for_access_log(state, request, engine, prompt_ids, completion)

    if stream:
        events = render.stream(
            outputs, params.n, include_usage, state.ping_interval_s, lead, on_done
        )
        return StreamingResponse(
            events, media_type="text/event-stream", headers={**generation.SSE_HEADERS, **headers}
        )
    completion = None
    try:
        choices = await generation.collect(request, outputs)
        generation.raise_for_failure(choices)
        completion = Completion.from_states(choices, len(prompt_ids))
    finally:
        await flow.finish_lead(lead, completion)
    await on_done(completion)
    headers["x-rebar-timing"] = timing_header(
        timing_fields(completion.timing, completion.num_cached_tokens)
    )
    return JSONResponse(render.json(completion), headers=headers)


def note_for_access_log(
    state: ServerState,
    request: Request,
    engine: AsyncEngine,
    prompt_ids: list[int],
    completion: Completion,
) -> None:
    """Token counts (and, only when `log_prompts` is on, the texts) for this request's access-log line."""
    fields = {
        "prompt_tokens": completion.num_prompt_tokens,
        "completion_tokens": completion.num_completion_tokens,
        **timing_fields(completion.timing, completion.num_cached_tokens),
    }
    if state.log_prompts:
        fields["prompt"] = engine.core.tokenizer.decode(prompt_ids, skip_special_tokens=False)
        fields["completions"] = [choice.text for choice in completion.choices]
    request.scope.setdefault("state", {}).setdefault("log", {}).update(fields)
