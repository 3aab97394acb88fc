"""Which pages a summary's statement came from: the blocks that share the most content words with
it (rarer words weigh more), among the pages the statement was summarised from."""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from rebar.documents.model import Block

_WORD = re.compile(r"[a-z][a-z'-]+")
STOPWORDS = frozenset(
    """a about above after again against all also am an and any are as at be because been before
    being below between both but by can could did do does doing down during each few for from
    further had has have having he her here hers herself him himself his how i if in into is it its
    itself just me more most my myself no nor not now of off on once only or other our ours out over
    own same she should so some such than that the their theirs them themselves then there these
    they this those through to too under until up very was we were what when where which while who
    whom why will with would you your yours yourself document text summary section page pages part
    parts also one two many much may might must shall often which""".split()
)
MAX_BLOCKS = 2  # a statement cites the pages of at most this many blocks


def content_words(text: str) -> set[str]:
    """Lower-case words of three letters or more, stop words dropped, a plural `s` removed."""
    words = set()
    for word in _WORD.findall(text.lower()):
        word = word.strip("'-")
        if len(word) < 3 or word in STOPWORDS:
            continue
        words.add(word[:-1] if len(word) > 3 and word.endswith("s") else word)
    return words


@dataclass(frozen=True)
class Statement:
    """One sentence (or list item) of a summary and the pages it came from (empty when no page
    shares enough words with it: the model said something the document does not)."""

    text: str
    pages: tuple[int, ...]


class Attributor:
    """Finds the source pages of statements in one document's blocks."""

    def __init__(self, blocks: Sequence[Block]) -> None:
        self._blocks = [(b, content_words(b.text)) for b in blocks if not b.is_heading]
        counts = Counter(w for _, words in self._blocks for w in words)
        total = max(len(self._blocks), 1)
        self._weight = {w: math.log(1 + total / n) for w, n in counts.items()}

    def statement(self, text: str, pages: Iterable[int]) -> Statement:
        """`text` with the pages (among `pages`) of the blocks sharing the most words with it: at
        least two words, or all of them for a statement of fewer."""
        allowed = set(pages)
        words = content_words(text)
        needed = min(2, len(words))
        scored = []
        for block, block_words in self._blocks:
            shared = words & block_words
            if block.page in allowed and shared and len(shared) >= needed:
                scored.append((sum(self._weight[w] for w in shared), block.page))
        scored.sort(reverse=True)
        return Statement(text, tuple(sorted({page for _, page in scored[:MAX_BLOCKS]})))
