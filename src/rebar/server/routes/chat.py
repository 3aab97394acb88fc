"""POST /v1/chat/completions."""

from __future__ import annotations

from collections.abc import Iterator

from fastapi import APIRouter, Request
from fastapi.responses import Response

from rebar.engine.outputs import Choice, RequestOutput
from rebar.model.tokenizer import Tokenizer
from rebar.server import reasoning, sse
from rebar.server.completion_flow import Completion
from rebar.server.context import request_context
from rebar.server.convert import chat_input
from rebar.server.reasoning import ReasoningSplitter, thinking_start
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
        thinking_start(llm, list(admitted.prompt_token_ids)),
    )
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return await respond(
        state, request, engine, render, "chat", admitted, body.stream, include_usage
    )


class ChatRenderer(Renderer):
    object_name = "chat.completion.chunk"

    def __init__(
        self,
        tokenizer: Tokenizer,
        response_id: str,
        model: str,
        with_logprobs: bool,
        thinking: bool | None = None,
    ) -> None:
        """`thinking`: None for a model that does not think; else whether its answers start
        inside the `<think>` block (the prompt opened it)."""
        super().__init__(response_id, model)
        self.tokenizer, self.with_logprobs = tokenizer, with_logprobs
        self.thinking = thinking
        self._splitters: dict[int, ReasoningSplitter] = {}

    def _split(self, text: str) -> tuple[str, str]:
        """A whole answer as (reasoning, content); all content for a model that does not think."""
        return ("", text) if self.thinking is None else reasoning.split(text, self.thinking)

    def _message(self, text: str) -> dict:
        thought, content = self._split(text)
        message = {"role": "assistant", "content": content}
        return message | ({"reasoning_content": thought} if self.thinking is not None else {})

    def json(self, completion: Completion) -> dict:
        return {
            "id": self.response_id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": [
                {
                    "index": c.index,
                    "message": self._message(c.text),
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

    def _delta(self, index: int, text: str, logprobs: list, thought: str = "") -> str:
        lp = chat_logprobs(self.tokenizer, logprobs) if self.with_logprobs else None
        delta = ({"reasoning_content": thought} if thought else {}) | (
            {"content": text} if text or not thought else {}
        )
        return self.chunk([{"index": index, "delta": delta, "logprobs": lp, "finish_reason": None}])

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
        thought, text = "", output.text_delta
        if self.thinking is not None:
            splitter = self._splitters.setdefault(
                output.index, ReasoningSplitter.for_prompt(self.thinking)
            )
            thought, text = splitter.feed(output.text_delta)
            if output.finished:
                held_thought, held_text = splitter.finish()
                thought, text = thought + held_thought, text + held_text
        if thought or text or (self.with_logprobs and output.logprobs):
            yield self._delta(output.index, text, list(output.logprobs), thought)
        if output.finished:
            error = sse.error_event(output)
            if error:
                yield error
            yield self._final(output.index, output.finish_reason)

    def replay_chunks(self, choice: Choice) -> Iterator[str]:
        thought, text = self._split(choice.text)
        if thought or text or choice.logprobs:
            yield self._delta(choice.index, text, list(choice.logprobs), thought)
        yield self._final(choice.index, choice.finish_reason)
