"""The answer stage: what the engine wrote, read for the client — a thinking model's reasoning told
apart from its content, tool calls parsed out of the text (whole, or as they stream), token
logprobs with their text. Fresh streams, whole answers and cache replays all come out as the same
neutral results (`rebar.server.pipeline.results`)."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable

from rebar.engine.outputs import Choice, RequestOutput
from rebar.engine.sampler import TokenLogprobs
from rebar.model.tokenizer import Tokenizer
from rebar.server.pipeline import reasoning
from rebar.server.pipeline.call import Live
from rebar.server.pipeline.reasoning import ReasoningSplitter
from rebar.server.pipeline.results import (
    PING,
    Answer,
    AnswerChoice,
    ChoiceEnd,
    Completion,
    Delta,
    Event,
    StreamEnd,
    StreamItem,
    TokenLogprob,
    ToolCall,
    ToolCallDelta,
    Usage,
    timing_fields,
)
from rebar.server.pipeline.tool_call_stream import StreamEvent, ToolCallStream
from rebar.server.pipeline.tool_calls import ToolCallReader, new_call_id


class AnswerReader:
    """Reads one request's answers. `thinking`: None for a model that does not think; else
    whether its answers start inside the `<think>` block (the prompt opened it). `tools` reads tool
    calls out of the answers (None: answers are all text). Logprobs are read only when
    `with_logprobs`."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        with_logprobs: bool,
        thinking: bool | None = None,
        tools: ToolCallReader | None = None,
    ) -> None:
        self.tokenizer, self.with_logprobs = tokenizer, with_logprobs
        self.thinking, self.tools = thinking, tools
        self._splitters: dict[int, ReasoningSplitter] = {}
        self._tool_streams: dict[int, ToolCallStream] = {}

    # ----- whole answers -----------------------------------------------------------------
    def read(self, completion: Completion) -> Answer:
        usage = Usage(
            completion.num_prompt_tokens,
            completion.num_completion_tokens,
            completion.num_cached_tokens,
        )
        timing = (
            None
            if completion.timing is None
            else timing_fields(completion.timing, completion.num_cached_tokens)
        )
        return Answer(tuple(self.choice(c) for c in completion.choices), usage, timing)

    def choice(self, choice: Choice) -> AnswerChoice:
        reasoning_text, content, calls = self._parts(choice.text)
        return AnswerChoice(
            choice.index,
            content,
            reasoning_text,
            calls,
            choice.finish_reason,
            self._logprobs(choice.logprobs),
            choice.error,
            _stop_string(choice.stop_reason),
        )

    def _parts(self, text: str) -> tuple[str | None, str, tuple[ToolCall, ...]]:
        """A whole answer as (reasoning, content, tool calls)."""
        thought, content = (
            (None, text) if self.thinking is None else reasoning.split(text, self.thinking)
        )
        if self.tools is None:
            return thought, content, ()
        parsed = self.tools.parse(content)
        calls = tuple(ToolCall(new_call_id(), c.name, c.arguments) for c in parsed.calls)
        return thought, parsed.content, calls

    def _logprobs(self, entries: tuple[TokenLogprobs, ...]) -> tuple[TokenLogprob, ...] | None:
        if not self.with_logprobs:
            return None
        return tuple(
            TokenLogprob(
                self._token(e.token_id),
                e.logprob,
                tuple((self._token(t), lp) for t, lp in e.top),
            )
            for e in entries
        )

    def _token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    # ----- streams -----------------------------------------------------------------------
    def events(self, output: RequestOutput) -> list[Event]:
        """What one engine output adds to its choice, in the answer's order."""
        index, thought, text = output.index, "", output.text_delta
        if self.thinking is not None:
            splitter = self._splitters.setdefault(
                index, ReasoningSplitter.for_prompt(self.thinking)
            )
            thought, text = splitter.feed(output.text_delta)
            if output.finished:
                held_thought, held_text = splitter.finish()
                thought, text = thought + held_thought, text + held_text
        text, after = self._tool_events(index, text, output.finished)
        events: list[Event] = []
        logprobs = self._logprobs(output.logprobs)
        if thought or text or logprobs:
            events.append(Delta(index, text, thought, logprobs))
        events += after
        if output.finished:
            stream = self._tool_streams.get(index)
            has_calls = bool(stream and stream.num_calls)
            stop = _stop_string(output.stop_reason)
            events.append(ChoiceEnd(index, output.finish_reason, has_calls, output.error, stop))
        return events

    def _tool_events(self, index: int, text: str, final: bool) -> tuple[str, list[Event]]:
        """The content before the first tool call in `text`, then the events of what follows it
        (call pieces, and any later text), in the order the answer has them."""
        if self.tools is None:
            return text, []
        stream = self._tool_streams.setdefault(index, ToolCallStream(self.tools))
        pieces = stream.feed(text) + (stream.finish() if final else [])
        first_call = next((i for i, e in enumerate(pieces) if e.tool_call), len(pieces))
        lead = "".join(e.content for e in pieces[:first_call])
        return lead, [_event(index, e) for e in pieces[first_call:] if e.tool_call or e.content]

    async def live(
        self, live: Live, on_done: Callable[[Completion], None]
    ) -> AsyncGenerator[StreamItem, None]:
        """A live stream read for the client: keep-alives, each output's events, then its end
        (`on_done` gets the whole answer first)."""
        try:
            async for item in live:
                if item is None:
                    yield PING
                elif isinstance(item, Completion):
                    on_done(item)
                    cached = item.num_cached_tokens
                    usage = Usage(item.num_prompt_tokens, item.num_completion_tokens, cached)
                    yield StreamEnd(usage, timing_fields(item.timing, cached))
                else:
                    yield self.events(item)
        finally:
            await live.aclose()

    async def replayed(self, completion: Completion) -> AsyncGenerator[StreamItem, None]:
        """A whole (cached) answer as the items of a stream: each choice's events, then the end
        (no timing: nothing was computed)."""
        for choice in completion.choices:
            yield self.replay(choice)
        usage = Usage(
            completion.num_prompt_tokens,
            completion.num_completion_tokens,
            completion.num_cached_tokens,
        )
        yield StreamEnd(usage, None)

    def log_fields(self, completion: Completion, with_texts: bool) -> dict[str, object]:
        """Token counts and timing (and, only `with_texts`, the answers' texts) for the access
        log."""
        fields: dict[str, object] = {
            "prompt_tokens": completion.num_prompt_tokens,
            "completion_tokens": completion.num_completion_tokens,
            **timing_fields(completion.timing, completion.num_cached_tokens),
        }
        if with_texts:
            fields["completions"] = [choice.text for choice in completion.choices]
        return fields

    def replay(self, choice: Choice) -> list[Event]:
        """A whole (cached) choice as the events of a stream."""
        read = self.choice(choice)
        events: list[Event] = []
        if read.reasoning or read.content or choice.logprobs:
            events.append(Delta(choice.index, read.content, read.reasoning or "", read.logprobs))
        for i, call in enumerate(read.tool_calls):
            events.append(ToolCallDelta(choice.index, i, call.id, call.name, call.arguments))
        events.append(
            ChoiceEnd(
                choice.index,
                choice.finish_reason,
                bool(read.tool_calls),
                stop_sequence=read.stop_sequence,
            )
        )
        return events


def _event(index: int, piece: StreamEvent) -> Event:
    call = piece.tool_call
    if call is None:
        return Delta(index, piece.content)
    return ToolCallDelta(index, call.index, call.id, call.name, call.arguments)


def _stop_string(stop_reason: str | int | None) -> str | None:
    """The stop string that ended a choice (a stop token's id is not one)."""
    return stop_reason if isinstance(stop_reason, str) else None
