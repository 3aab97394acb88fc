"""What extraction produces: a document as an ordered list of text blocks, each with its position
(page and the heading it sits under)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Kind = Literal["pdf", "markdown", "text", "html", "docx"]


@dataclass(frozen=True)
class Block:
    """One paragraph (or heading) of a document. `page` counts from 1: a PDF's page, a DOCX's
    rendered or explicit page break, a form feed in text; `section` is the nearest heading above
    it (None before the first)."""

    text: str
    page: int
    section: str | None = None
    is_heading: bool = False


@dataclass(frozen=True)
class Document:
    """An extracted document: `blocks` in reading order, `num_pages` (1 for formats without
    pages), and the SHA-256 of the file's bytes (what summaries are cached under)."""

    name: str
    kind: Kind
    blocks: tuple[Block, ...]
    num_pages: int
    sha256: str

    @property
    def sections(self) -> list[str]:
        """The headings, in order, each once."""
        return list(dict.fromkeys(b.text for b in self.blocks if b.is_heading))

    def page_text(self, page: int) -> str:
        return "\n\n".join(b.text for b in self.blocks if b.page == page)


@dataclass(frozen=True)
class DocumentLimits:
    """The bounds a document must stay within to be read."""

    max_bytes: int
    max_pages: int
