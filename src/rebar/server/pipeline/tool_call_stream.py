"""Tool calls read out of an answer as it streams: content deltas, and tool-call pieces (per call
its index, id and name first, then the arguments in fragments).

Hermes blocks are read as they come; Llama 3 JSON and Mistral answers cannot be told from text
until they end, so a stream that starts like one holds its text back until then.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from rebar.server.pipeline.tool_calls import (
    HERMES_CLOSE,
    HERMES_OPEN,
    MISTRAL_CALLS,
    PYTHON_TAG,
    ToolCallReader,
    json_or_none,
    new_call_id,
)


@dataclass(frozen=True)
class CallPiece:
    """Part of the answer's call number `index`: the first piece has its `id` and `name`, later
    ones more of its `arguments` (JSON text)."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class StreamEvent:
    """Text of the answer (`content`), or a piece of a tool call (`tool_call`)."""

    content: str = ""
    tool_call: CallPiece | None = None
    after_call: bool = False  # content that follows a call of the same answer


_HERMES_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')


@dataclass
class _OpenCall:
    """A `<tool_call>` block being streamed."""

    text: str = ""
    cuts: list[int] = field(default_factory=list)  # where each streamed delta ended in `text`
    index: int = -1  # the call's index among tool_calls, once its name went out
    arguments_start: int = -1
    sent: int = 0  # characters of the arguments already streamed


@dataclass
class ToolCallStream:
    """Splits a streamed answer into content and tool-call deltas; `finish()` at the end."""

    reader: ToolCallReader
    _pending: str = ""  # text not yet sent
    _call: _OpenCall | None = None
    _num_calls: int = 0
    _holding: bool | None = None  # whole-answer formats: None until the answer's start is seen
    _whole: str = ""
    _blank: str = ""  # whitespace after a call, not yet known to belong to the answer

    @property
    def num_calls(self) -> int:
        return self._num_calls

    def feed(self, delta: str) -> list[StreamEvent]:
        if self.reader.format != "hermes":
            return self._feed_whole(delta)
        return self._without_blanks_between_calls(self._feed_hermes(delta))

    def _without_blanks_between_calls(self, events: list[StreamEvent]) -> list[StreamEvent]:
        """Blank text after a call is held until more text shows it is part of the answer (the
        newlines between calls are not)."""
        kept = []
        for event in events:
            if event.tool_call is not None or not event.after_call:
                kept.append(event)
            elif (self._blank + event.content).strip():
                kept.append(StreamEvent(content=self._blank + event.content))
                self._blank = ""
            else:
                self._blank += event.content
        return kept

    def _feed_hermes(self, delta: str) -> list[StreamEvent]:
        self._pending += delta
        events: list[StreamEvent] = []
        while True:
            if self._call is None:
                # Without parallel calls, blocks after the first are text.
                may_open = self.reader.parallel or not self._num_calls
                start = self._pending.find(HERMES_OPEN) if may_open else -1
                if start < 0:  # hold back what may be the start of a tag
                    keep = _partial_suffix(self._pending, HERMES_OPEN) if may_open else 0
                    text, self._pending = _cut(self._pending, len(self._pending) - keep)
                    if text:
                        events.append(self._text(text))
                    return events
                text, self._pending = _cut(self._pending, start)
                if text:
                    events.append(self._text(text))
                self._pending = self._pending[len(HERMES_OPEN) :]
                self._call = _OpenCall()
            call = self._call
            call.text += self._pending
            call.cuts.append(len(call.text))
            self._pending = ""
            if self.reader.forced:
                events += self._advance(call)
            end = call.text.find(HERMES_CLOSE)
            if end < 0:
                return events
            events += self._close(call, end)

    def _text(self, text: str) -> StreamEvent:
        return StreamEvent(content=text, after_call=self._num_calls > 0)

    def _advance(self, call: _OpenCall) -> list[StreamEvent]:
        """Name and argument fragments of the open call, as far as its text allows."""
        events: list[StreamEvent] = []
        if call.index < 0:
            head = _HERMES_HEAD.match(call.text)
            if head is None or json_or_none(f'"{head.group(1)}"') not in self.reader.names:
                return events
            call.index, call.arguments_start = self._num_calls, head.end()
            self._num_calls += 1
            name = json.loads(f'"{head.group(1)}"')
            events.append(StreamEvent(tool_call=CallPiece(call.index, new_call_id(), name)))
        if call.sent == 0:  # the value starts at its first non-blank character
            while (
                call.arguments_start < len(call.text) and call.text[call.arguments_start].isspace()
            ):
                call.arguments_start += 1
        value = call.text[call.arguments_start :]
        close = value.find(HERMES_CLOSE)
        value = (
            value[:close]
            if close >= 0
            else value[: len(value) - _partial_suffix(value, HERMES_CLOSE)]
        )
        try:
            _, upto = json.JSONDecoder().raw_decode(value)
        except ValueError:  # still being written: all of it belongs to the arguments so far
            upto = len(value)
        fragment = value[call.sent : upto]
        if fragment:
            call.sent = upto
            events.append(StreamEvent(tool_call=CallPiece(call.index, arguments=fragment)))
        return events

    def _close(self, call: _OpenCall, end: int) -> list[StreamEvent]:
        block = call.text[:end]
        self._pending = call.text[end + len(HERMES_CLOSE) :]
        self._call = None
        if call.index >= 0:
            return []
        parsed = self.reader.call_from(json_or_none(block))
        if parsed is None:  # not a call after all: the block is text
            return [self._text(HERMES_OPEN + block + HERMES_CLOSE)]
        index = self._num_calls
        self._num_calls += 1
        events = [StreamEvent(tool_call=CallPiece(index, new_call_id(), parsed.name))]
        for fragment in _fragments(block, call.cuts, parsed.arguments):
            events.append(StreamEvent(tool_call=CallPiece(index, arguments=fragment)))
        return events

    def _feed_whole(self, delta: str) -> list[StreamEvent]:
        self._whole += delta
        if self._holding is None:
            start = self._whole.lstrip()
            if not start:
                return []
            markers = ("{", PYTHON_TAG) if self.reader.format == "llama3_json" else (MISTRAL_CALLS,)
            if any(start.startswith(m) for m in markers):
                self._holding = True
            elif any(m.startswith(start) for m in markers):
                return []  # too short to tell
            else:
                self._holding = False
        if self._holding:
            return []
        text, self._whole = self._whole, ""
        return [StreamEvent(content=text)] if text else []

    def finish(self) -> list[StreamEvent]:
        """What is still held back, at the end of the answer."""
        if self.reader.format != "hermes":
            text, self._whole = self._whole, ""
            if not self._holding:
                return [StreamEvent(content=text)] if text else []
            answer = self.reader.parse(text)
            events = [StreamEvent(content=answer.content)] if answer.content else []
            for parsed in answer.calls:
                piece = CallPiece(self._num_calls, new_call_id(), parsed.name, parsed.arguments)
                events.append(StreamEvent(tool_call=piece))
                self._num_calls += 1
            return events
        events = []
        if self._call is not None:  # an unclosed block: text, unless its call already went out
            open_call, self._call = self._call, None
            if open_call.index < 0:
                events.append(self._text(HERMES_OPEN + open_call.text))
        if self._pending:
            events.append(self._text(self._pending))
            self._pending = ""
        return self._without_blanks_between_calls(events)


def _fragments(block: str, cuts: list[int], arguments: str) -> list[str]:
    """The arguments as written in `block`, cut where the stream's deltas ended (`arguments`, the
    normalised text, in one piece when the block does not start with the name)."""
    head = _HERMES_HEAD.match(block)
    if head is None:
        return [arguments]
    try:
        _, length = json.JSONDecoder().raw_decode(block, head.end())
    except ValueError:
        return [arguments]
    start = head.end()
    inside = [c for c in cuts if start < c < length]
    return [block[a:b] for a, b in zip([start, *inside], [*inside, length], strict=True)]


def _cut(text: str, at: int) -> tuple[str, str]:
    return text[:at], text[at:]


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that begins `marker` (held back: it may be one)."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0
