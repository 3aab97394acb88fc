"""POST /v1/completions."""

from __future__ import annotations

from collections.abc import Iterator

from fastapi import APIRouter, Request

from rebar.engine.outputs import RequestOutput
from rebar.errors import InvalidRequestError
from rebar.model.tokenizer import Tokenizer
from rebar.server import generation, prompts
from rebar.server.completion_flow import ChoiceResult, Completion
from rebar.server.convert import completion_logprobs, completion_params, openai_finish_reason, usage
from rebar.server.rendering import Renderer, respond
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
    raise InvalidRequestError(
        "send one prompt per request (a string or a list of token ids); batches are not supported",
        "prompt",
    )


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    state = request.app.state.rebar
    llm, engine = state.chat_model(body.model)
    params = completion_params(body)
    prompt = _single_prompt(body.prompt)
    prompt_ids = await prompts.text_prompt(llm, prompt)
    if body.echo and not isinstance(prompt, str):
        engine.core.check_request(
            prompt_ids, params
        )  # only ids the model has can be decoded for the echo
    echo_text = (
        (prompt if isinstance(prompt, str) else llm.tokenizer.decode(prompt)) if body.echo else ""
    )
    response_id = f"cmpl-{request.scope['state']['internal_id']}"
    render = CompletionRenderer(
        llm.tokenizer, response_id, body.model, echo_text, params.logprobs is not None, params.n
    )
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return await respond(
        state,
        request,
        engine,
        render,
        "completions",
        prompt_ids,
        params,
        body.stream,
        include_usage,
    )


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
            error = generation.stream_error(output) if output.finished else None
            if error:
                yield error
            reason = output.finish_reason if output.finished else None
            yield self._piece(
                output.index, output.text_delta, list(output.logprobs), offset, reason
            )

    def replay_chunks(self, choice: ChoiceResult) -> Iterator[str]:
        yield self._piece(choice.index, choice.text, list(choice.logprobs), 0, choice.finish_reason)
