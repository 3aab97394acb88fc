"""POST /v1/chat/completions."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from rebar.engine.outputs import RequestOutput
from rebar.engine.prompt import prompt_token_ids
from rebar.model.tokenizer import Tokenizer
from rebar.server import generation
from rebar.server.convert import chat_logprobs, chat_params, now, openai_finish_reason, usage
from rebar.server.schemas import ChatCompletionRequest

router = APIRouter()


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    state = request.app.state.rebar
    llm, engine = state.chat_model(body.model)
    params = chat_params(body)
    prompt = llm.render_chat([m.model_dump(exclude_none=True) for m in body.messages])
    prompt_ids = prompt_token_ids(llm.tokenizer, prompt)
    request_id = request.scope["state"]["request_id"]
    outputs = await generation.start(state, engine, prompt_ids, params, request_id)
    response_id = f"chatcmpl-{request_id}"
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        events = _stream(outputs, llm.tokenizer, response_id, body.model, params.n, include_usage, state.ping_interval_s)
        return StreamingResponse(events, media_type="text/event-stream", headers=generation.SSE_HEADERS)
    choices = await generation.collect(request, outputs)
    generation.raise_for_failure(choices)
    num_completion = sum(len(c.token_ids) for c in choices.values())
    return JSONResponse({
        "id": response_id,
        "object": "chat.completion",
        "created": now(),
        "model": body.model,
        "choices": [
            {
                "index": index,
                "message": {"role": "assistant", "content": choice.text},
                "logprobs": chat_logprobs(llm.tokenizer, choice.logprobs) if params.logprobs is not None else None,
                "finish_reason": openai_finish_reason(choice.finish_reason),
            }
            for index, choice in sorted(choices.items())
        ],
        "usage": usage(len(prompt_ids), num_completion, choices[0].num_cached_tokens),
    })


async def _stream(outputs: AsyncIterator[RequestOutput], tokenizer: Tokenizer, response_id: str, model: str,
                  n: int, include_usage: bool, ping_interval_s: float) -> AsyncIterator[str]:
    created = now()

    def chunk(choices: list[dict], **extra) -> str:
        return generation.sse({"id": response_id, "object": "chat.completion.chunk", "created": created, "model": model,
                               "choices": choices, **extra})

    for index in range(n):
        yield chunk([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}])
    num_completion, last = 0, None
    async for output in generation.with_pings(outputs, ping_interval_s):
        if output is None:
            yield generation.PING
            continue
        last = output
        num_completion += len(output.new_token_ids)
        logprobs = chat_logprobs(tokenizer, list(output.logprobs))
        if output.text_delta or logprobs:
            yield chunk([{"index": output.index, "delta": {"content": output.text_delta}, "logprobs": logprobs, "finish_reason": None}])
        if output.finished:
            error = generation.stream_error(output)
            if error:
                yield error
            yield chunk([{"index": output.index, "delta": {}, "logprobs": None, "finish_reason": openai_finish_reason(output.finish_reason)}])
    if include_usage and last is not None:
        yield chunk([], usage=usage(last.num_prompt_tokens, num_completion, last.num_cached_tokens))
    yield generation.sse("[DONE]")
