"""POST /v1/chat/completions."""

from __future__ import annotations

from collections.abc import Iterator

from fastapi import APIRouter, Request
from fastapi.responses import Response

from rebar.engine.outputs import Choice, RequestOutput
from rebar.model.tokenizer import Tokenizer
from rebar.server import sse
from rebar.server.completion_flow import Completion
from rebar.server.context import request_context
from rebar.server.convert import chat_input
from rebar.server.rendering import Renderer, respond
from rebar.server.response_fields import chat_logprobs, openai_finish_reason, usage
from rebar.server.schemas import ChatCompletionRequest
from rebar.server.state import server_state

router = APIRouter()


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    state = server_state(request)
    llm, engine = state.chat_model(body.model)
    admitted = await chat_input(engine, llm, body)
    render = ChatRenderer(
        llm.tokenizer,
        f"chatcmpl-{request_context(request.scope).internal_id}",
        body.model,
        admitted.params.logprobs is not None,
    )
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return await respond(
        state, request, engine, render, "chat", admitted, body.stream, include_usage
    )


class ChatRenderer(Renderer):
    object_name = "chat.completion.chunk"

    def __init__(
        self, tokenizer: Tokenizer, response_id: str, model: str, with_logprobs: bool
    ) -> None:
        super().__init__(response_id, model)
        self.tokenizer, self.with_logprobs = tokenizer, with_logprobs

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
                    "logprobs": chat_logprobs(self.tokenizer, list(c.logprobs))
                    if self.with_logprobs
                    else None,
                    "finish_reason": openai_finish_reason(c.finish_reason),
                }
                for c in completion.choices
            ],
            "usage": usage(
                completion.num_prompt_tokens,
                completion.num_completion_tokens,
                completion.num_cached_tokens,
            ),
        }

    def _delta(self, index: int, text: str, logprobs: list) -> str:
        lp = chat_logprobs(self.tokenizer, logprobs) if self.with_logprobs else None
        return self.chunk(
            [{"index": index, "delta": {"content": text}, "logprobs": lp, "finish_reason": None}]
        )

    def _final(self, index: int, reason: str | None) -> str:
        return self.chunk(
            [
                {
                    "index": index,
                    "delta": {},
                    "logprobs": None,
                    "finish_reason": openai_finish_reason(reason),
                }
            ]
        )

    def opening(self, n: int) -> Iterator[str]:
        for index in range(n):
            yield self.chunk(
                [
                    {
                        "index": index,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ]
            )

    def output_chunks(self, output: RequestOutput) -> Iterator[str]:
        if output.text_delta or (self.with_logprobs and output.logprobs):
            yield self._delta(output.index, output.text_delta, list(output.logprobs))
        if output.finished:
            error = sse.error_event(output)
            if error:
                yield error
            yield self._final(output.index, output.finish_reason)

    def replay_chunks(self, choice: Choice) -> Iterator[str]:
        if choice.text or choice.logprobs:
            yield self._delta(choice.index, choice.text, list(choice.logprobs))
        yield self._final(choice.index, choice.finish_reason)
