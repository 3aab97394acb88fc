"""Drafts from the sequence itself: when its last few tokens occurred before (in the prompt or in
what it generated), propose the tokens that followed them there.

Answers that edit, quote, extract or summarise a given text repeat long spans of it; so do agents
resending a context. No second model: each sequence keeps an index of where each of its short
n-grams last ended, filled in bulk for the prompt and one token at a time after, so a lookup costs
a few dictionary reads whatever the length.

The longest suffix that occurred before wins (a longer match is a better predictor); among its
occurrences the most recent (nearest text is the likeliest to be copied next). How far the match
really reaches back decides how much a proposal is trusted: a copy in progress (the last
COPY_MATCH tokens or more seen before, in order) holds nineteen times in twenty on the bench's
grounded answers, a short cue about half as often, so each keeps its own record (the cue
"copy" or "ngram", see `Speculator`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rebar.engine.scheduler import ScheduledRequest
    from rebar.engine.spec.speculator import Drafting

# Suffix lengths tried, longest first. One token is too weak a cue: after a common token (a space,
# a comma) almost anything follows.
MIN_NGRAM = 2
MAX_NGRAM = 4
# A match reaching back this many tokens is a copy in progress (cue "copy"); a shorter one, "ngram".
COPY_MATCH = 8


class NgramIndex:
    """Where each n-gram (MIN_NGRAM..MAX_NGRAM tokens) of one sequence last ended.

    Callers may rely on: `propose` only ever proposes tokens that followed an earlier occurrence of
    the sequence's current suffix, in order; the sequence passed must only ever grow (its earlier
    tokens never change), as a request's tokens do.
    """

    def __init__(self, min_n: int = MIN_NGRAM, max_n: int = MAX_NGRAM) -> None:
        assert 1 <= min_n <= max_n
        self.sizes = tuple(range(max_n, min_n - 1, -1))  # longest first
        self._last_end: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self.sizes}
        self._num_indexed = 0  # n-grams ending before this position are in the index
        self.matched = 0  # how far the last proposal's match reached back (capped at COPY_MATCH)

    def propose(self, tokens: Sequence[int], max_tokens: int) -> tuple[int, ...]:
        """Up to `max_tokens` tokens that followed the latest earlier occurrence of the longest
        suffix of `tokens` seen before; empty when no suffix of MIN_NGRAM tokens or more was."""
        length = len(tokens)
        # The suffix itself ends at length - 1: only earlier occurrences may be found.
        self._index_until(tokens, length - 1)
        self.matched = 0
        if max_tokens <= 0:
            return ()
        for n in self.sizes:
            if n > length:
                continue
            end = self._last_end[n].get(tuple(tokens[length - n :]))
            if end is not None:
                self.matched = _reach(tokens, end, n)
                return _continuation(tokens, end, max_tokens)
        return ()

    def _index_until(self, tokens: Sequence[int], stop: int) -> None:
        """Index every n-gram ending at a position before `stop`."""
        start = self._num_indexed
        if stop <= start:
            return
        for n, table in self._last_end.items():
            first = max(start, n - 1)
            if first >= stop:
                continue
            # The n-grams ending at first..stop-1, built by zipping n shifted slices (C speed for a
            # long prompt); later ends overwrite earlier ones, so each keeps its latest.
            columns = [tokens[first - n + 1 + k : stop - n + 1 + k] for k in range(n)]
            table.update(zip(zip(*columns), range(first, stop)))
        self._num_indexed = stop


def _reach(tokens: Sequence[int], end: int, n: int) -> int:
    """How many tokens ending at `end` equal the sequence's last ones (n of them already known to),
    counted up to COPY_MATCH."""
    last = len(tokens) - 1
    reach = n
    while reach < COPY_MATCH and end - reach >= 0 and tokens[end - reach] == tokens[last - reach]:
        reach += 1
    return reach


def _continuation(tokens: Sequence[int], end: int, max_tokens: int) -> tuple[int, ...]:
    """The `max_tokens` tokens after position `end`, read as if the sequence's end were there: past
    the sequence's last token the proposal repeats itself (a loop of period len - 1 - end)."""
    length = len(tokens)
    proposal = list(tokens[end + 1 : end + 1 + max_tokens])
    while len(proposal) < max_tokens:
        proposal.append(proposal[end + 1 + len(proposal) - length])
    return tuple(proposal)


class NgramDrafter:
    """The n-gram drafter: each sequence's own `NgramIndex`, consulted when the step is planned."""

    name = "ngram"

    def outlook(self, sequence: Drafting, max_tokens: int) -> int:
        speculation = sequence.speculation
        index = speculation.drafter_state
        if not isinstance(index, NgramIndex):
            index = speculation.drafter_state = NgramIndex()
        speculation.planned = index.propose(sequence.request.token_ids, max_tokens)
        speculation.cue = "copy" if index.matched >= COPY_MATCH else "ngram"
        return len(speculation.planned)

    def draft(self, batch: Sequence[tuple[Drafting, ScheduledRequest]]) -> list[tuple[int, ...]]:
        return [sequence.speculation.planned[: item.num_lookahead] for sequence, item in batch]
