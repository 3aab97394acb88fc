"""POST /v1/completions."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from rebar.engine.outputs import RequestOutput
from rebar.engine.prompt import prompt_token_ids
from rebar.errors import InvalidRequestError
from rebar.model.tokenizer import Tokenizer
from rebar.server import completion_flow as flow
from rebar.server import generation
from rebar.server.completion_flow import Completion
from rebar.server.convert import ChoiceState, accumulate, completion_logprobs, completion_params, now, openai_finish_reason, usage
from rebar.server.response_cache import Lead
from rebar.server.schemas import CompletionRequest

router = APIRouter()


def _single_prompt(prompt: str | list) -> str | list[int]:
    """rebar serves one prompt per request (use `n` for several completions of it)."""
    if isinstance(prompt, str):
        return prompt
    if prompt and all(isinstance(t, int) for t in prompt):
        return prompt
    if len(prompt) == 1:
        return prompt[0]
    raise InvalidRequestError("send one prompt per request (a string or a list of token ids); batches are not supported", "prompt")


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    state = request.app.state.rebar
    llm, engine = state.chat_model(body.model)
    params = completion_params(body)
    prompt = _single_prompt(body.prompt)
    prompt_ids = prompt_token_ids(llm.tokenizer, prompt)
    engine.core.check_request(prompt_ids, params)
    headers = await flow.check_rate_limit(state, request, len(prompt_ids))
    echo_text = (prompt if isinstance(prompt, str) else llm.tokenizer.decode(prompt)) if body.echo else ""
    request_id = request.scope["state"]["request_id"]
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    render = _Renderer(llm.tokenizer, f"cmpl-{request_id}", body.model, echo_text, params.logprobs is not None)

    cached, lead, cache_header = await flow.cache_lookup(state, request, body.model, flow.canonical_request("completions", prompt_ids, params), params)
    if cache_header:
        headers["X-Cache"] = cache_header
    if cached is not None:
        completion = Completion.from_json(cached, len(prompt_ids))
        if body.stream:
            return StreamingResponse(render.replay(completion, include_usage), media_type="text/event-stream",
                                     headers={**generation.SSE_HEADERS, **headers})
        return JSONResponse(render.json(completion), headers=headers)

    try:
        outputs = await generation.start(state, engine, prompt_ids, params, request_id)
    except BaseException:
        await flow.finish_lead(lead, None)
        raise
    if body.stream:
        events = render.stream(outputs, params.n, include_usage, state.ping_interval_s, lead,
                               lambda tokens: flow.charge_completion(state, request, tokens))
        return StreamingResponse(events, media_type="text/event-stream", headers={**generation.SSE_HEADERS, **headers})
    completion = None
    try:
        choices = await generation.collect(request, outputs)
        generation.raise_for_failure(choices)
        completion = Completion.from_states(choices, len(prompt_ids))
    finally:
        await flow.finish_lead(lead, completion)
    await flow.charge_completion(state, request, completion.num_completion_tokens)
    return JSONResponse(render.json(completion), headers=headers)


class _Renderer:
    """Completion-shaped JSON and SSE chunks for one response."""

    def __init__(self, tokenizer: Tokenizer, response_id: str, model: str, echo_text: str, with_logprobs: bool) -> None:
        self.tokenizer, self.response_id, self.model = tokenizer, response_id, model
        self.echo_text, self.with_logprobs = echo_text, with_logprobs
        self.created = now()

    def json(self, completion: Completion) -> dict:
        return {
            "id": self.response_id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [
                {
                    "index": c.index,
                    "text": self.echo_text + c.text,
                    "logprobs": completion_logprobs(self.tokenizer, list(c.logprobs)) if self.with_logprobs else None,
                    "finish_reason": openai_finish_reason(c.finish_reason),
                }
                for c in completion.choices
            ],
            "usage": usage(completion.num_prompt_tokens, completion.num_completion_tokens, completion.num_cached_tokens),
        }

    def chunk(self, choices: list[dict], **extra) -> str:
        return generation.sse({"id": self.response_id, "object": "text_completion", "created": self.created,
                               "model": self.model, "choices": choices, **extra})

    def _piece(self, index: int, text: str, logprobs: list, offset: int, reason: str | None) -> str:
        lp = completion_logprobs(self.tokenizer, logprobs, offset) if self.with_logprobs else None
        return self.chunk([{"index": index, "text": text, "logprobs": lp, "finish_reason": openai_finish_reason(reason)}])

    def _echo(self, n: int):
        if self.echo_text:
            for index in range(n):
                yield self.chunk([{"index": index, "text": self.echo_text, "logprobs": None, "finish_reason": None}])

    async def replay(self, completion: Completion, include_usage: bool) -> AsyncIterator[str]:
        for event in self._echo(len(completion.choices)):
            yield event
        for choice in completion.choices:
            yield self._piece(choice.index, choice.text, list(choice.logprobs), 0, choice.finish_reason)
        if include_usage:
            yield self.chunk([], usage=usage(completion.num_prompt_tokens, completion.num_completion_tokens, completion.num_cached_tokens))
        yield generation.sse("[DONE]")

    async def stream(self, outputs: AsyncIterator[RequestOutput], n: int, include_usage: bool, ping_interval_s: float,
                     lead: Lead | None, charge) -> AsyncIterator[str]:
        choices: dict[int, ChoiceState] = {}
        offsets = dict.fromkeys(range(n), 0)
        completion = None
        last = None
        try:
            for event in self._echo(n):
                yield event
            async for output in generation.with_pings(outputs, ping_interval_s):
                if output is None:
                    yield generation.PING
                    continue
                last = output
                accumulate(choices, output)
                offset = offsets[output.index]
                offsets[output.index] += len(output.text_delta)
                if output.text_delta or (self.with_logprobs and output.logprobs) or output.finished:
                    error = generation.stream_error(output) if output.finished else None
                    if error:
                        yield error
                    reason = output.finish_reason if output.finished else None
                    yield self._piece(output.index, output.text_delta, list(output.logprobs), offset, reason)
            completion = Completion.from_states(choices, last.num_prompt_tokens if last else 0)
            if include_usage and last is not None:
                yield self.chunk([], usage=usage(completion.num_prompt_tokens, completion.num_completion_tokens, last.num_cached_tokens))
            yield generation.sse("[DONE]")
        finally:
            await flow.finish_lead(lead, completion if completion and len(choices) == n else None)
            if completion is not None:
                await charge(completion.num_completion_tokens)
