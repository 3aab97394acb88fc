"""POST /v1/completions."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from rebar.engine.outputs import RequestOutput
from rebar.engine.prompt import prompt_token_ids
from rebar.errors import InvalidRequestError
from rebar.model.tokenizer import Tokenizer
from rebar.server import generation
from rebar.server.convert import completion_logprobs, completion_params, now, openai_finish_reason, usage
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
    echo_text = (prompt if isinstance(prompt, str) else llm.tokenizer.decode(prompt)) if body.echo else ""
    request_id = request.scope["state"]["request_id"]
    outputs = await generation.start(state, engine, prompt_ids, params, request_id)
    response_id = f"cmpl-{request_id}"
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        events = _stream(outputs, llm.tokenizer, response_id, body.model, echo_text, params.n, include_usage, state.ping_interval_s)
        return StreamingResponse(events, media_type="text/event-stream", headers=generation.SSE_HEADERS)
    choices = await generation.collect(request, outputs)
    generation.raise_for_failure(choices)
    return JSONResponse({
        "id": response_id,
        "object": "text_completion",
        "created": now(),
        "model": body.model,
        "choices": [
            {
                "index": index,
                "text": echo_text + choice.text,
                "logprobs": completion_logprobs(llm.tokenizer, choice.logprobs) if params.logprobs is not None else None,
                "finish_reason": openai_finish_reason(choice.finish_reason),
            }
            for index, choice in sorted(choices.items())
        ],
        "usage": usage(len(prompt_ids), sum(len(c.token_ids) for c in choices.values()), choices[0].num_cached_tokens),
    })


async def _stream(outputs: AsyncIterator[RequestOutput], tokenizer: Tokenizer, response_id: str, model: str, echo_text: str,
                  n: int, include_usage: bool, ping_interval_s: float) -> AsyncIterator[str]:
    created = now()
    offsets = dict.fromkeys(range(n), 0)

    def chunk(choices: list[dict], **extra) -> str:
        return generation.sse({"id": response_id, "object": "text_completion", "created": created, "model": model,
                               "choices": choices, **extra})

    if echo_text:
        for index in range(n):
            yield chunk([{"index": index, "text": echo_text, "logprobs": None, "finish_reason": None}])
    num_completion, last = 0, None
    async for output in generation.with_pings(outputs, ping_interval_s):
        if output is None:
            yield generation.PING
            continue
        last = output
        num_completion += len(output.new_token_ids)
        logprobs = completion_logprobs(tokenizer, list(output.logprobs), offsets[output.index])
        offsets[output.index] += len(output.text_delta)
        if output.text_delta or logprobs or output.finished:
            error = generation.stream_error(output) if output.finished else None
            if error:
                yield error
            reason = openai_finish_reason(output.finish_reason) if output.finished else None
            yield chunk([{"index": output.index, "text": output.text_delta, "logprobs": logprobs, "finish_reason": reason}])
    if include_usage and last is not None:
        yield chunk([], usage=usage(last.num_prompt_tokens, num_completion, last.num_cached_tokens))
    yield generation.sse("[DONE]")
