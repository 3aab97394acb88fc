"""Reading tool calls out of a model's answer, whole or as it streams, for each family's format.

- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, as Qwen 2.5 / 3,
  Hermes and many GGUF templates write them, and as rebar's own tool prompt asks models without a
  format of their own to (the bundled SmolLM2 and Gemma 3). Streamed as it comes: the name as
  soon as it is written, then the arguments in fragments.
- `llama3_json`: the whole answer is `{"name": ..., "parameters": {...}}` (Llama 3.1-3.3), maybe
  after `<|python_tag|>`; several calls may be separated by `;`.
- `mistral`: `[TOOL_CALLS]` then a JSON list of `{"name": ..., "arguments": {...}}`, or (newer
  templates) `[TOOL_CALLS]name[ARGS]{...}` per call.

A call counts only when it parses and names one of the request's tools with an object of
arguments; anything else stays in the answer's text, so a tool-call-looking passage in a normal
answer is never cut. Streams are read by `rebar.server.pipeline.tool_call_stream`.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

Format = Literal["hermes", "llama3_json", "mistral"]

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
MISTRAL_CALLS, MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # the arguments object as JSON text, as the model wrote it


@dataclass(frozen=True)
class ParsedAnswer:
    content: str
    calls: tuple[ParsedCall, ...]


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCallReader:
    """Parses answers of one format for a request's tools (`names`); `parallel` False keeps the
    first call only (later ones stay text). `forced`: a grammar makes every call valid, so a
    stream may send a call's arguments while they are written; otherwise a call goes out once its
    block has closed and parsed (in the fragments it arrived in), so text is never mistaken for
    one."""

    def __init__(
        self, fmt: Format, names: Iterable[str], parallel: bool = True, forced: bool = False
    ) -> None:
        self.format, self.names, self.parallel = fmt, frozenset(names), parallel
        self.forced = forced

    def parse(self, text: str) -> ParsedAnswer:
        if self.format == "hermes":
            return self._parse_hermes(text)
        if self.format == "llama3_json":
            return self._whole_answer(text, _llama3_calls)
        return self._whole_answer(text, _mistral_calls)

    def call_from(self, value: Any, arguments_key: str = "arguments") -> ParsedCall | None:
        """A call from a decoded {"name", arguments_key} object, if it names a known tool."""
        if not isinstance(value, dict) or set(value) != {"name", arguments_key}:
            return None
        name, arguments = value["name"], value[arguments_key]
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return None
        if name not in self.names or not isinstance(arguments, dict):
            return None
        return ParsedCall(name, json.dumps(arguments, ensure_ascii=False))

    def _parse_hermes(self, text: str) -> ParsedAnswer:
        content: list[str] = []
        calls: list[ParsedCall] = []
        position = 0
        for match in re.finditer(
            re.escape(HERMES_OPEN) + r"(.*?)" + re.escape(HERMES_CLOSE), text, re.S
        ):
            call = None
            if self.parallel or not calls:
                call = self.call_from(json_or_none(match.group(1)))
            content.append(text[position : match.start()] if call else text[position : match.end()])
            position = match.end()
            if call:
                calls.append(call)
        content.append(text[position:])
        return ParsedAnswer("".join(content).strip() if calls else text, tuple(calls))

    def _whole_answer(self, text: str, decode) -> ParsedAnswer:
        values = decode(text) or []
        calls = [self.call_from(v, key) for v, key in values]
        if not calls or None in calls:
            return ParsedAnswer(text, ())
        if self.parallel or len(calls) == 1:
            return ParsedAnswer("", tuple(c for c in calls if c is not None))
        # One call only: the first; the others stay in the answer, as JSON, not dropped.
        rest = json.dumps([v for v, _ in values[1:]], ensure_ascii=False)
        return ParsedAnswer(rest, (calls[0],) if calls[0] else ())


def json_or_none(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _llama3_calls(text: str) -> list[tuple[Any, str]] | None:
    body = text.strip()
    body = body.removeprefix(PYTHON_TAG).strip()
    if not body.startswith("{"):
        return None
    values = []
    for piece in _split_top_level(body, ";"):
        value = json_or_none(piece)
        if value is None:
            return None
        key = "parameters" if isinstance(value, dict) and "parameters" in value else "arguments"
        values.append((value, key))
    return values


def _mistral_calls(text: str) -> list[tuple[Any, str]] | None:
    body = text.strip()
    if not body.startswith(MISTRAL_CALLS):
        return None
    body = body[len(MISTRAL_CALLS) :].strip()
    if body.startswith("["):
        value = json_or_none(body)
        if not isinstance(value, list) or not value:
            return None
        return [(v, "arguments") for v in value]
    values = []
    for piece in body.split(MISTRAL_CALLS):  # name[ARGS]{...} per call
        name, marker, arguments = piece.partition(MISTRAL_ARGS)
        decoded = json_or_none(arguments)
        if not marker or decoded is None:
            return None
        values.append(({"name": name.strip(), "arguments": decoded}, "arguments"))
    return values


def _split_top_level(text: str, separator: str) -> list[str]:
    """`text` split at `separator` outside JSON strings, objects and lists."""
    pieces, depth, start, in_string, escaped = [], 0, 0, False, False
    for i, char in enumerate(text):
        if in_string:
            escaped = not escaped and char == "\\"
            if char == '"' and not escaped:
                in_string = False
            continue
        if char == '"':
            in_string = True
        elif char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
        elif char == separator and depth == 0:
            pieces.append(text[start:i])
            start = i + 1
    pieces.append(text[start:])
    return [p for p in pieces if p.strip()]
