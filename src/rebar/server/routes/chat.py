"""POST /v1/chat/completions."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from rebar.engine.outputs import RequestOutput
from rebar.engine.prompt import prompt_token_ids
from rebar.model.tokenizer import Tokenizer
from rebar.server import completion_flow as flow
from rebar.server import generation
from rebar.server.completion_flow import Completion
from rebar.server.convert import ChoiceState, accumulate, chat_logprobs, chat_params, now, openai_finish_reason, usage
from rebar.server.response_cache import Lead
from rebar.server.schemas import ChatCompletionRequest

router = APIRouter()


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    state = request.app.state.rebar
    llm, engine = state.chat_model(body.model)
    params = chat_params(body)
    prompt = llm.render_chat([m.model_dump(exclude_none=True) for m in body.messages])
    prompt_ids = prompt_token_ids(llm.tokenizer, prompt)
    engine.core.check_request(prompt_ids, params)
    headers = await flow.check_rate_limit(state, request, len(prompt_ids))
    request_id = request.scope["state"]["request_id"]
    response_id = f"chatcmpl-{request_id}"
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    render = _Renderer(llm.tokenizer, response_id, body.model, params.logprobs is not None)

    cached, lead, cache_header = await flow.cache_lookup(state, request, body.model, flow.canonical_request("chat", prompt_ids, params), params)
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
    """Chat-shaped JSON and SSE chunks for one response."""

    def __init__(self, tokenizer: Tokenizer, response_id: str, model: str, with_logprobs: bool) -> None:
        self.tokenizer, self.response_id, self.model, self.with_logprobs = tokenizer, response_id, model, with_logprobs
        self.created = now()

    def json(self, completion: Completion) -> dict:
        return {
            "id": self.response_id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": [
                {
                    "index": c.index,
                    "message": {"role": "assistant", "content": c.text},
                    "logprobs": chat_logprobs(self.tokenizer, list(c.logprobs)) if self.with_logprobs else None,
                    "finish_reason": openai_finish_reason(c.finish_reason),
                }
                for c in completion.choices
            ],
            "usage": usage(completion.num_prompt_tokens, completion.num_completion_tokens, completion.num_cached_tokens),
        }

    def chunk(self, choices: list[dict], **extra) -> str:
        return generation.sse({"id": self.response_id, "object": "chat.completion.chunk", "created": self.created,
                               "model": self.model, "choices": choices, **extra})

    def _delta(self, index: int, text: str, logprobs: list) -> str:
        lp = chat_logprobs(self.tokenizer, logprobs) if self.with_logprobs else None
        return self.chunk([{"index": index, "delta": {"content": text}, "logprobs": lp, "finish_reason": None}])

    def _final(self, index: int, reason: str | None) -> str:
        return self.chunk([{"index": index, "delta": {}, "logprobs": None, "finish_reason": openai_finish_reason(reason)}])

    def _role(self, index: int) -> str:
        return self.chunk([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}])

    async def replay(self, completion: Completion, include_usage: bool) -> AsyncIterator[str]:
        """A cached answer as the same SSE sequence a fresh one produces."""
        for choice in completion.choices:
            yield self._role(choice.index)
        for choice in completion.choices:
            if choice.text or choice.logprobs:
                yield self._delta(choice.index, choice.text, list(choice.logprobs))
            yield self._final(choice.index, choice.finish_reason)
        if include_usage:
            yield self.chunk([], usage=usage(completion.num_prompt_tokens, completion.num_completion_tokens, completion.num_cached_tokens))
        yield generation.sse("[DONE]")

    async def stream(self, outputs: AsyncIterator[RequestOutput], n: int, include_usage: bool, ping_interval_s: float,
                     lead: Lead | None, charge) -> AsyncIterator[str]:
        choices: dict[int, ChoiceState] = {}
        completion = None
        last = None
        try:
            for index in range(n):
                yield self._role(index)
            async for output in generation.with_pings(outputs, ping_interval_s):
                if output is None:
                    yield generation.PING
                    continue
                last = output
                accumulate(choices, output)
                if output.text_delta or (self.with_logprobs and output.logprobs):
                    yield self._delta(output.index, output.text_delta, list(output.logprobs))
                if output.finished:
                    error = generation.stream_error(output)
                    if error:
                        yield error
                    yield self._final(output.index, output.finish_reason)
            completion = Completion.from_states(choices, last.num_prompt_tokens if last else 0)
            if include_usage and last is not None:
                yield self.chunk([], usage=usage(completion.num_prompt_tokens, completion.num_completion_tokens, last.num_cached_tokens))
            yield generation.sse("[DONE]")
        finally:
            await flow.finish_lead(lead, completion if completion and len(choices) == n else None)
            if completion is not None:
                await charge(completion.num_completion_tokens)
