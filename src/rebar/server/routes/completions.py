"""POST /v1/completions."""

from __future__ import annotations

from collections.abc import Iterator

from fastapi import APIRouter, Request
from fastapi.responses import Response

from rebar.engine.outputs import Choice, RequestOutput
from rebar.model.tokenizer import Tokenizer
from rebar.server import sse
from rebar.server.completion_flow import Completion
from rebar.server.context import request_context
from rebar.server.convert import completion_input
from rebar.server.model_instance import ModelInstance
from rebar.server.rendering import Renderer, respond
from rebar.server.response_fields import completion_logprobs, openai_finish_reason, usage
from rebar.server.schemas import CompletionRequest
from rebar.server.state import server_state

router = APIRouter()


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    state = server_state(request)

    async def build(model: ModelInstance) -> Response:
        llm, engine = model.text, model.engine
        assert engine is not None, "a chat model's instance has an engine"
        admitted, echo_text = await completion_input(engine, llm, body)
        params = admitted.params
        render = CompletionRenderer(
            llm.tokenizer,
            f"cmpl-{request_context(request.scope).internal_id}",
            body.model,
            echo_text,
            params.logprobs is not None,
            params.n,
        )
        render.version = model.label
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return await respond(
            state, request, engine, render, "completions", admitted, body.stream, include_usage
        )

    return await state.serve(body.model, "chat", build)


class CompletionRenderer(Renderer):
    object_name = "text_completion"

    def __init__(
        self,
        tokenizer: Tokenizer,
        response_id: str,
        model: str,
        echo_text: str,
        with_logprobs: bool,
        n: int,
    ) -> None:
        super().__init__(response_id, model)
        self.tokenizer, self.echo_text, self.with_logprobs = tokenizer, echo_text, with_logprobs
        self.offsets = dict.fromkeys(
            range(n), 0
        )  # characters streamed so far per choice, for text_offset

    def json(self, completion: Completion) -> dict:
        return {
            "id": self.response_id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.version,
            "choices": [
                {
                    "index": c.index,
                    "text": self.echo_text + c.text,
                    "logprobs": completion_logprobs(self.tokenizer, list(c.logprobs))
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

    def _piece(self, index: int, text: str, logprobs: list, offset: int, reason: str | None) -> str:
        lp = completion_logprobs(self.tokenizer, logprobs, offset) if self.with_logprobs else None
        return self.chunk(
            [
                {
                    "index": index,
                    "text": text,
                    "logprobs": lp,
                    "finish_reason": openai_finish_reason(reason),
                }
            ]
        )

    def opening(self, n: int) -> Iterator[str]:
        if self.echo_text:
            for index in range(n):
                yield self.chunk(
                    [
                        {
                            "index": index,
                            "text": self.echo_text,
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ]
                )

    def output_chunks(self, output: RequestOutput) -> Iterator[str]:
        offset = self.offsets[output.index]
        self.offsets[output.index] += len(output.text_delta)
        if output.text_delta or (self.with_logprobs and output.logprobs) or output.finished:
            error = sse.error_event(output) if output.finished else None
            if error:
                yield error
            reason = output.finish_reason if output.finished else None
            yield self._piece(
                output.index, output.text_delta, list(output.logprobs), offset, reason
            )

    def replay_chunks(self, choice: Choice) -> Iterator[str]:
        yield self._piece(choice.index, choice.text, list(choice.logprobs), 0, choice.finish_reason)
