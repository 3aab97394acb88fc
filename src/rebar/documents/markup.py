"""Plain text, Markdown and HTML: paragraphs and headings; form feeds in text start a new page."""

from __future__ import annotations

import re

from rebar.documents.blocks import BlockWriter
from rebar.documents.errors import MalformedDocument
from rebar.documents.model import Block

_ATX = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
_SETEXT = re.compile(r"^ {0,3}(=+|-+)\s*$")
_FENCE = re.compile(r"^ {0,3}(```|~~~)")
HEADINGS = ("h1", "h2", "h3", "h4", "h5", "h6")
# Elements whose text is one paragraph; an element inside another of these belongs to it.
_HTML_BLOCKS = (*HEADINGS, "p", "li", "pre", "blockquote", "dt", "dd", "td", "th", "caption")
_NOT_TEXT = ("script", "style", "noscript", "template", "head")


def decode_text(name: str, data: bytes) -> str:
    """UTF-8 (with or without a byte-order mark); anything else is MalformedDocument."""
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise MalformedDocument(
            f"{name}: not UTF-8 text (byte {exc.start} is {data[exc.start]:#04x})"
        ) from None


def text_blocks(text: str) -> tuple[list[Block], int]:
    writer = BlockWriter()
    for number, page in enumerate(text.split("\f"), start=1):
        writer.page = number
        writer.text(page)
    return writer.blocks, writer.page


def markdown_blocks(text: str) -> tuple[list[Block], int]:
    """ATX (`# Title`) and setext (underlined) headings; fenced code stays one paragraph."""
    writer = BlockWriter()
    pending: list[str] = []
    in_fence = False

    def flush() -> None:
        writer.text("\n".join(pending))
        pending.clear()

    for line in text.split("\n"):
        if "\f" in line:
            flush()
            writer.page += line.count("\f")
            line = line.replace("\f", "")
        if _FENCE.match(line):
            in_fence = not in_fence
        atx = None if in_fence else _ATX.match(line)
        if atx:
            flush()
            writer.heading(atx.group(2))
        elif not in_fence and _SETEXT.match(line) and _one_line_paragraph(pending):
            title = pending.pop()
            flush()
            writer.heading(title)
        else:
            pending.append(line)
    flush()
    return writer.blocks, writer.page


def _one_line_paragraph(lines: list[str]) -> bool:
    """Whether the last line is a paragraph of its own (a setext heading's title)."""
    return bool(lines) and bool(lines[-1].strip()) and (len(lines) == 1 or not lines[-2].strip())


def html_blocks(text: str) -> tuple[list[Block], int]:
    """Headings and paragraph-like elements in document order; scripts and styles dropped. A page
    with text but none of those elements is read as plain text."""
    from bs4 import BeautifulSoup, Tag  # on first use: its import is ~0.25 s of a server's start

    soup = BeautifulSoup(text, "html.parser")
    for element in soup.find_all(_NOT_TEXT):
        element.decompose()
    writer = BlockWriter()
    for element in soup.find_all(_HTML_BLOCKS):
        if not isinstance(element, Tag) or element.find_parent(_HTML_BLOCKS) is not None:
            continue
        content = element.get_text(" ", strip=True)
        if element.name in HEADINGS:
            writer.heading(content)
        else:
            writer.paragraph(content)
    if not writer.blocks:
        writer.text(soup.get_text("\n"))
    return writer.blocks, 1
