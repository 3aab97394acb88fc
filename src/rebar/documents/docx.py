"""DOCX text with python-docx: paragraphs and table cells in order, `Heading N`/`Title` styles as
headings, rendered and explicit page breaks as pages."""

from __future__ import annotations

import io
import zipfile
from typing import Any

import docx
from docx.opc.exceptions import PackageNotFoundError
from docx.table import Table
from docx.text.paragraph import Paragraph

from rebar.documents.blocks import BlockWriter
from rebar.documents.errors import DocumentTooLarge, MalformedDocument
from rebar.documents.model import Block, DocumentLimits

# How much larger than the file its unpacked parts may be: a zip bomb stops here.
MAX_EXPANSION = 20
_PAGE_BREAK = ".//w:br[@w:type='page']"


def docx_blocks(name: str, data: bytes, limits: DocumentLimits) -> tuple[list[Block], int]:
    _check_unpacked_size(name, data, limits)
    try:
        document = docx.Document(io.BytesIO(data))
        writer = BlockWriter()
        for item in document.iter_inner_content():
            if isinstance(item, Paragraph):
                _paragraph(writer, item)
            elif isinstance(item, Table):
                _table(writer, item)
            if writer.page > limits.max_pages:
                raise DocumentTooLarge(
                    f"{name}: more than the {limits.max_pages} pages allowed (documents.max_pages)"
                )
    except (PackageNotFoundError, zipfile.BadZipFile, KeyError, ValueError) as exc:
        raise MalformedDocument(f"{name}: not a readable DOCX file ({exc})") from None
    return writer.blocks, writer.page


def _paragraph(writer: BlockWriter, paragraph: Paragraph) -> None:
    if paragraph.contains_page_break or paragraph._p.xpath(_PAGE_BREAK):
        writer.page += 1
    style = paragraph.style.name if paragraph.style is not None else ""
    if style and (style.startswith("Heading") or style == "Title"):
        writer.heading(paragraph.text)
    else:
        writer.paragraph(paragraph.text)


def _table(writer: BlockWriter, table: Table) -> None:
    for row in table.rows:
        cells: list[Any] = list(dict.fromkeys(cell.text.strip() for cell in row.cells))
        writer.paragraph(" | ".join(c for c in cells if c))


def _check_unpacked_size(name: str, data: bytes, limits: DocumentLimits) -> None:
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            unpacked = sum(info.file_size for info in archive.infolist())
    except zipfile.BadZipFile as exc:
        raise MalformedDocument(f"{name}: not a readable DOCX file ({exc})") from None
    if unpacked > max(MAX_EXPANSION * len(data), limits.max_bytes):
        raise DocumentTooLarge(
            f"{name}: unpacks to {unpacked} bytes, more than its size allows (a zip bomb?)"
        )
