"""Incremental detokenization with stop strings.

Text is released as soon as it is final: never half a UTF-8 character (byte-level BPE tokens can
split one), never the beginning of a stop string that later tokens might complete. When the
request ends, the full text equals `decode(all ids)` cut before the first stop string.
"""

from __future__ import annotations

import functools
from array import array
from collections.abc import Sequence

from rebar.model.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"


@functools.lru_cache(maxsize=64)
def _borders(stop: str) -> array:
    """KMP prefix function: entry i is the length of the longest proper prefix of stop[: i + 1] that
    is also its suffix.

    Cached because every choice of a request, and most requests of a chat model, share their stop
    strings; callers must not modify the result.
    """
    borders = array("i", [0]) * len(stop)
    length = 0
    for i in range(1, len(stop)):
        while length and stop[i] != stop[length]:
            length = borders[length - 1]
        if stop[i] == stop[length]:
            length += 1
        borders[i] = length
    return borders


class _StopMatcher:
    """Follows one stop string through text fed to it piece by piece (Knuth-Morris-Pratt).

    `state` is the length of the longest suffix of the text fed so far that is a proper prefix of
    the stop string. Feeding costs amortised O(1) per character, whatever the stop's length.
    """

    __slots__ = ("_borders", "state", "stop")

    def __init__(self, stop: str) -> None:
        self.stop = stop
        self.state = 0
        self._borders = _borders(stop)

    def feed(self, text: str) -> int | None:
        """Advance over `text`; returns the end (in `text`) of the stop's first occurrence ending in
        it, or None."""
        stop, borders, state = self.stop, self._borders, self.state
        first_end = None
        for index, char in enumerate(text):
            while state and stop[state] != char:
                state = borders[state - 1]
            if stop[state] == char:
                state += 1
            if state == len(stop):
                if first_end is None:
                    first_end = index + 1
                state = borders[state - 1]  # stay a proper prefix, so the next characters continue
        self.state = state
        return first_end


def _partial_stop_length(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string.

    What the detokenizer holds back, computed from scratch; the detokenizer itself keeps its
    matchers and feeds them only the new text.
    """
    matchers = [_StopMatcher(stop) for stop in stops]
    for matcher in matchers:
        matcher.feed(text)
    return max((m.state for m in matchers), default=0)


class IncrementalDetokenizer:
    """Feed token ids one at a time with `add`; each call returns the newly final text."""

    def __init__(
        self, tokenizer: Tokenizer, stop: Sequence[str] = (), skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._stop = tuple(stop)
        self._skip_special = skip_special_tokens
        self.token_ids: list[int] = []
        self.text = ""  # decoded so far (stop strings not yet removed)
        self._prefix_offset = 0  # window start: a few tokens of context so pieces merge right
        self._read_offset = 0  # tokens already turned into `text`
        self._emitted = 0  # characters of `text` already returned
        self.stop_string: str | None = None  # the stop string that ended the text, if any
        # One matcher per stop string, fed every character appended to `text`: per token the
        # stop search and the held-back prefix cost time in the new text, not in the stops' length.
        self._matchers = [_StopMatcher(stop) for stop in self._stop]

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def add(self, token_id: int) -> str:
        """Append one token; returns the text that became final (possibly empty)."""
        if self.stop_string is not None:
            return ""
        self.token_ids.append(token_id)
        before = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
        after = self._decode(self.token_ids[self._prefix_offset :])
        if len(after) > len(before) and not after.endswith(REPLACEMENT_CHAR):
            self._append(after[len(before) :])
            self._prefix_offset, self._read_offset = self._read_offset, len(self.token_ids)
        return self._release(final=False)

    def _append(self, new_text: str) -> None:
        """Extend `text`; cut it before the earliest-starting stop string that the new text
        completes.

        Every earlier occurrence was found when it completed, so only occurrences ending in the new
        text can be new; among them the one starting first wins (ties: the first in `stop`).
        """
        start = len(self.text)
        self.text += new_text
        best: tuple[int, str] | None = None
        for matcher in self._matchers:
            end = matcher.feed(new_text)
            if end is not None:
                index = start + end - len(matcher.stop)
                if best is None or index < best[0]:
                    best = (index, matcher.stop)
        if best is not None:
            self.text = self.text[: best[0]]
            self.stop_string = best[1]

    def _held_back_length(self) -> int:
        """Characters at the end of `text` that may begin a stop string: held back until
        resolved."""
        return max((m.state for m in self._matchers), default=0)

    def _find_stop(self) -> None:
        """Search the final text, which `finish` decodes afresh, for a stop string (once per
        request)."""
        # A stop string can only newly appear in the tail that was not yet released.
        search_from = max(0, self._emitted - max((len(s) for s in self._stop), default=0))
        best: tuple[int, str] | None = None
        for stop in self._stop:
            index = self.text.find(stop, search_from)
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is not None:
            self.text = self.text[: best[0]]
            self.stop_string = best[1]

    def _release(self, final: bool) -> str:
        if final and self.stop_string is None:
            self._find_stop()
        end = len(self.text)
        if not final and self.stop_string is None:
            end -= self._held_back_length()
        delta = self.text[self._emitted : end]
        self._emitted = max(self._emitted, end)
        return delta

    @property
    def num_released_chars(self) -> int:
        """Characters of text returned so far by `add` and `finish`."""
        return self._emitted

    @property
    def stopped(self) -> bool:
        return self.stop_string is not None

    def finish(self) -> str:
        """The request ended: release everything left, including a trailing incomplete character."""
        if self.stop_string is None:
            self.text = self._decode(self.token_ids)
        return self._release(final=True)
