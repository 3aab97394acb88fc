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
from rebar.server.model_instance import ModelInstance
from rebar.server.reasoning import ReasoningSplitter, thinking_start
from rebar.server.rendering import Renderer, respond
from rebar.server.response_fields import chat_logprobs, openai_finish_reason, usage
from rebar.server.schemas import ChatCompletionRequest
from rebar.server.state import server_state
from rebar.server.tool_call_stream import ToolCallStream
from rebar.server.tool_calls import ToolCallReader, new_call_id, openai_tool_call

router = APIRouter()


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    state = server_state(request)

    async def build(model: ModelInstance) -> Response:
        llm, engine = model.text, model.engine
        assert engine is not None, "a chat model's instance has an engine"
        admitted, tools = await chat_input(engine, llm, body)
        render = ChatRenderer(
            llm.tokenizer,
            f"chatcmpl-{request_context(request.scope).internal_id}",
            body.model,
            admitted.params.logprobs is not None,
            thinking_start(llm, list(admitted.prompt_token_ids)),
            tools.reader if tools is not None else None,
        )
        render.version = model.label
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return await respond(
            state, request, engine, render, "chat", admitted, body.stream, include_usage
        )

    return await state.serve(body.model, "chat", build)


class ChatRenderer(Renderer):
    object_name = "chat.completion.chunk"

    def __init__(
        self,
        tokenizer: Tokenizer,
        response_id: str,
        model: str,
        with_logprobs: bool,
        thinking: bool | None = None,
        tools: ToolCallReader | None = None,
    ) -> None:
        """`thinking`: None for a model that does not think; else whether its answers start
        inside the `<think>` block (the prompt opened it). `tools` reads tool calls out of the
        answers (None: answers are all text)."""
        super().__init__(response_id, model)
        self.tokenizer, self.with_logprobs = tokenizer, with_logprobs
        self.thinking = thinking
        self.tools = tools
        self._splitters: dict[int, ReasoningSplitter] = {}
        self._tool_streams: dict[int, ToolCallStream] = {}

    def _split(self, text: str) -> tuple[str, str]:
        """A whole answer as (reasoning, content); all content for a model that does not think."""
        return ("", text) if self.thinking is None else reasoning.split(text, self.thinking)

    def _answer(self, text: str) -> tuple[str, str, list[dict]]:
        """A whole answer as (reasoning, content, tool calls)."""
        thought, content = self._split(text)
        if self.tools is None:
            return thought, content, []
        answer = self.tools.parse(content)
        calls = [openai_tool_call(call, new_call_id()) for call in answer.calls]
        return thought, answer.content, calls

    def _message(self, text: str) -> dict:
        thought, content, calls = self._answer(text)
        message: dict = {"role": "assistant", "content": content or (None if calls else "")}
        if calls:
            message["tool_calls"] = calls
        return message | ({"reasoning_content": thought} if self.thinking is not None else {})

    @staticmethod
    def _reason(reason: str | None, has_calls: bool) -> str | None:
        """OpenAI's finish_reason: "tool_calls" for an answer that ended by calling tools."""
        reason = openai_finish_reason(reason)
        return "tool_calls" if has_calls and reason == "stop" else reason

    def _choice(self, choice: Choice) -> dict:
        message = self._message(choice.text)
        return {
            "index": choice.index,
            "message": message,
            "logprobs": chat_logprobs(self.tokenizer, list(choice.logprobs))
            if self.with_logprobs
            else None,
            "finish_reason": self._reason(choice.finish_reason, "tool_calls" in message),
        }

    def json(self, completion: Completion) -> dict:
        return {
            "id": self.response_id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.version,
            "choices": [self._choice(c) for c in completion.choices],
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

    def _tool_call_delta(self, index: int, call: dict) -> str:
        return self.chunk(
            [
                {
                    "index": index,
                    "delta": {"tool_calls": [call]},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ]
        )

    def _final(self, index: int, reason: str | None, has_calls: bool = False) -> str:
        return self.chunk(
            [
                {
                    "index": index,
                    "delta": {},
                    "logprobs": None,
                    "finish_reason": self._reason(reason, has_calls),
                }
            ]
        )

    def _tool_events(self, index: int, text: str, final: bool) -> tuple[str, list[str]]:
        """The content before the first tool call in `text`, then the chunks of what follows
        it (call deltas, and any later text), in the order the answer has them."""
        if self.tools is None:
            return text, []
        stream = self._tool_streams.setdefault(index, ToolCallStream(self.tools))
        events = stream.feed(text) + (stream.finish() if final else [])
        first_call = next((i for i, e in enumerate(events) if e.tool_call), len(events))
        lead = "".join(e.content for e in events[:first_call])
        rest = [
            self._tool_call_delta(index, e.tool_call)
            if e.tool_call
            else self._delta(index, e.content, [])
            for e in events[first_call:]
            if e.tool_call or e.content
        ]
        return lead, rest

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
        text, after = self._tool_events(output.index, text, output.finished)
        if thought or text or (self.with_logprobs and output.logprobs):
            yield self._delta(output.index, text, list(output.logprobs), thought)
        yield from after
        if output.finished:
            error = sse.error_event(output)
            if error:
                yield error
            stream = self._tool_streams.get(output.index)
            yield self._final(output.index, output.finish_reason, bool(stream and stream.num_calls))

    def replay_chunks(self, choice: Choice) -> Iterator[str]:
        thought, text, calls = self._answer(choice.text)
        if thought or text or choice.logprobs:
            yield self._delta(choice.index, text, list(choice.logprobs), thought)
        for i, call in enumerate(calls):
            yield self._tool_call_delta(choice.index, {"index": i, **call})
        yield self._final(choice.index, choice.finish_reason, bool(calls))
