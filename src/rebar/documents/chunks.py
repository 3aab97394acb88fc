"""Splitting a document on its structure into chunks that fit a token budget: blocks are kept
whole where they fit, a new section starts a new chunk once the current one is half full (always,
when sections must not mix), and a block too long for any chunk is cut on sentences, then words."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from rebar.documents.model import Block

CountTokens = Callable[[str], int]
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


@dataclass(frozen=True)
class Chunk:
    """Consecutive blocks summarised in one request; `pages` are those its blocks are on."""

    index: int
    blocks: tuple[Block, ...]

    @property
    def text(self) -> str:
        return "\n\n".join(b.text for b in self.blocks)

    @property
    def pages(self) -> tuple[int, ...]:
        return tuple(sorted({b.page for b in self.blocks}))

    @property
    def section(self) -> str | None:
        return self.blocks[0].section


def split_blocks(
    blocks: Sequence[Block], budget: int, count: CountTokens, by_section: bool = False
) -> list[Chunk]:
    """Chunks of at most `budget` tokens each (counted on their text), in reading order."""
    chunks: list[list[Block]] = []
    current: list[Block] = []
    used = 0
    for block in (piece for b in blocks for piece in _fitting(b, budget, count)):
        size = count(block.text) + 2  # the blank line between blocks
        new_section = bool(current) and block.section != current[-1].section
        if current and (
            used + size > budget or (new_section and (by_section or used * 2 >= budget))
        ):
            chunks.append(current)
            current, used = [], 0
        current.append(block)
        used += size
    if current:
        chunks.append(current)
    return [Chunk(i, tuple(c)) for i, c in enumerate(chunks)]


def _fitting(block: Block, budget: int, count: CountTokens) -> list[Block]:
    """`block`, or pieces of it that each fit `budget`."""
    if count(block.text) + 2 <= budget:
        return [block]
    pieces: list[Block] = []
    for sentence in _SENTENCE_END.split(block.text):
        for part in _by_words(sentence, budget - 2, count):
            last = pieces[-1] if pieces else None
            joined = f"{last.text} {part}" if last else part
            if last is not None and count(joined) + 2 <= budget:
                pieces[-1] = Block(joined, block.page, block.section)
            else:
                pieces.append(Block(part, block.page, block.section))
    return pieces


def _by_words(text: str, budget: int, count: CountTokens) -> list[str]:
    """`text` cut between words into parts of at most `budget` tokens, each word counted once
    (with its leading space, as the tokenizer sees it inside a sentence)."""
    if count(text) <= budget:
        return [text]
    parts: list[str] = []
    words: list[str] = []
    used = 0
    for word in text.split():
        word = word[: max(budget // 4, 1)]  # a byte-level token is at least a quarter character
        size = count(" " + word)
        if words and used + size > budget:
            parts.append(" ".join(words))
            words, used = [], 0
        words.append(word)
        used += size
    if words:
        parts.append(" ".join(words))
    return parts
