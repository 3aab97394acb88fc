"""Incremental detokenization with stop strings.

Text is released as soon as it is final: never half a UTF-8 character (byte-level BPE tokens can
split one), never the beginning of a stop string that later tokens might complete. When the
request ends, the full text equals `decode(all ids)` cut before the first stop string.
"""

from __future__ import annotations

from collections.abc import Sequence

from rebar.model.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"


def _partial_stop_length(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    longest = 0
    for stop in stops:
        for length in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:length]):
                longest = length
                break
    return longest


class IncrementalDetokenizer:
    """Feed token ids one at a time with `add`; each call returns the newly final text."""

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = (), skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._stop = tuple(stop)
        self._skip_special = skip_special_tokens
        self.token_ids: list[int] = []
        self.text = ""  # decoded so far (stop strings not yet removed)
        self._prefix_offset = 0  # window start: a few tokens of context so pieces merge right
        self._read_offset = 0  # tokens already turned into `text`
        self._emitted = 0  # characters of `text` already returned
        self.stop_string: str | None = None  # the stop string that ended the text, if any

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
            self.text += after[len(before) :]
            self._prefix_offset, self._read_offset = self._read_offset, len(self.token_ids)
        return self._release(final=False)

    def _find_stop(self) -> None:
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
        self._find_stop()
        end = len(self.text)
        if not final and self.stop_string is None:
            end -= _partial_stop_length(self.text, self._stop)
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
