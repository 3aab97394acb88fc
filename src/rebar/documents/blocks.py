"""Building a document's blocks in reading order: each paragraph gets the page it is on and the
heading it sits under."""

from __future__ import annotations

import re

from rebar.documents.model import Block

_BLANK_LINES = re.compile(r"\n\s*\n")
_SPACES = re.compile(r"[ \t\r\f\v]+")


def paragraphs(text: str) -> list[str]:
    """`text` split on blank lines; each paragraph's lines joined with spaces."""
    found = []
    for part in _BLANK_LINES.split(text):
        joined = " ".join(_SPACES.sub(" ", line).strip() for line in part.splitlines())
        if joined.strip():
            found.append(joined.strip())
    return found


class BlockWriter:
    """Appends paragraphs and headings, keeping the current page and section."""

    def __init__(self) -> None:
        self.blocks: list[Block] = []
        self.page = 1
        self.section: str | None = None

    def heading(self, text: str) -> None:
        text = _SPACES.sub(" ", text).strip()
        if text:
            self.section = text
            self.blocks.append(Block(text, self.page, text, is_heading=True))

    def paragraph(self, text: str) -> None:
        text = _SPACES.sub(" ", text).strip()
        if text:
            self.blocks.append(Block(text, self.page, self.section))

    def text(self, text: str) -> None:
        """Free text: one block per paragraph."""
        for paragraph in paragraphs(text):
            self.paragraph(paragraph)
