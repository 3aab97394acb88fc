"""Cutting a model's streamed answer into statements (sentences, or list items) as they
complete, so each can be attributed and shown while the rest is still being written."""

from __future__ import annotations

import re

# A sentence ends at . ! or ? after a word (not a list number) and before what starts a sentence.
_SENTENCE_END = re.compile(r"(?<=[A-Za-z%)\]\"'][.!?])[\"')\]]?\s+(?=[A-Z0-9\"'(\[])")
_BULLET = re.compile(r"^\s*(?:[-*•]|\d+[.)])\s+")


class StatementSplitter:
    """Feed text deltas; get back each statement once it is complete, and the rest on `close`."""

    def __init__(self) -> None:
        self._pending = ""

    def feed(self, delta: str) -> list[str]:
        self._pending += delta
        done: list[str] = []
        while True:
            line_end = self._pending.find("\n")
            sentence = _SENTENCE_END.search(self._pending)
            if sentence is not None and (line_end < 0 or sentence.start() < line_end):
                cut, rest = sentence.start(), sentence.end()
            elif line_end >= 0:
                cut, rest = line_end, line_end + 1
            else:
                return done
            done.extend(_clean(self._pending[:cut]))
            self._pending = self._pending[rest:]

    def close(self) -> list[str]:
        rest, self._pending = self._pending, ""
        return _clean(rest)


def _clean(text: str) -> list[str]:
    """The statement in `text`, without its bullet or bold marks; none for a line that only
    introduces what follows ("Here are the key points:")."""
    text = _BULLET.sub("", text.replace("**", "")).strip()
    if text.endswith(":") or not any(ch.isalnum() for ch in text):
        return []
    return [text]


def split_statements(text: str) -> list[str]:
    splitter = StatementSplitter()
    return splitter.feed(text) + splitter.close()
