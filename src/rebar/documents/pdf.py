"""PDF text extraction with pypdf: the text layer page by page, headings from the outline."""

from __future__ import annotations

import io
import logging

from pypdf import PageObject, PdfReader
from pypdf.errors import DependencyError, FileNotDecryptedError, PdfReadError, PyPdfError

from rebar.documents.blocks import BlockWriter
from rebar.documents.errors import (
    DocumentTooLarge,
    EncryptedDocument,
    MalformedDocument,
    NoTextLayer,
)
from rebar.documents.model import Block, DocumentLimits

# pypdf warns through logging about recoverable damage; a summary does not need to hear of it.
logging.getLogger("pypdf").setLevel(logging.ERROR)


def pdf_blocks(name: str, data: bytes, limits: DocumentLimits) -> tuple[list[Block], int]:
    """(blocks, number of pages). Raises EncryptedDocument, DocumentTooLarge, NoTextLayer or
    MalformedDocument."""
    try:
        reader = PdfReader(io.BytesIO(data), strict=False)
        _decrypt(name, reader)
        num_pages = len(reader.pages)
        if num_pages > limits.max_pages:
            raise DocumentTooLarge(
                f"{name}: {num_pages} pages, more than the {limits.max_pages} allowed "
                "(documents.max_pages)"
            )
        headings = _outline_pages(reader)
        writer = BlockWriter()
        for index, page in enumerate(reader.pages):
            writer.page = index + 1
            for heading in headings.get(index, []):
                writer.heading(heading)
            writer.text(_page_text(page))
    except (FileNotDecryptedError, DependencyError) as exc:
        raise EncryptedDocument(f"{name}: the PDF is encrypted ({exc})") from None
    except (PdfReadError, PyPdfError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise MalformedDocument(
            f"{name}: not a readable PDF ({type(exc).__name__}: {exc})"
        ) from None
    if num_pages and not any(not b.is_heading for b in writer.blocks):
        raise NoTextLayer(
            f"{name}: none of its {num_pages} pages has a text layer (a scan?); "
            "rebar reads text, it does no OCR"
        )
    return writer.blocks, num_pages


def _page_text(page: PageObject) -> str:
    """The page's text with its vertical gaps kept as blank lines (paragraphs); pypdf's plain
    mode, which joins them, where layout mode cannot read the page."""
    try:
        return page.extract_text(extraction_mode="layout") or ""
    except (PyPdfError, ValueError, KeyError, TypeError, AttributeError, ZeroDivisionError):
        return page.extract_text() or ""


def _decrypt(name: str, reader: PdfReader) -> None:
    """A PDF encrypted with an empty user password (owner restrictions only) opens; any other
    needs its password."""
    if reader.is_encrypted and not reader.decrypt(""):
        raise EncryptedDocument(f"{name}: the PDF is password-protected")


def _outline_pages(reader: PdfReader) -> dict[int, list[str]]:
    """Outline (bookmark) titles by the 0-based page they point at; a damaged outline is
    skipped, not fatal."""
    found: dict[int, list[str]] = {}
    try:
        entries = list(_flatten(reader.outline))
    except (PyPdfError, ValueError, KeyError, TypeError, AttributeError):
        return found
    for entry in entries:
        try:
            page = reader.get_destination_page_number(entry)
        except (PyPdfError, ValueError, KeyError, TypeError, AttributeError):
            continue
        if page is not None and page >= 0 and entry.title:
            found.setdefault(page, []).append(str(entry.title))
    return found


def _flatten(outline: list) -> list:
    entries = []
    for item in outline:
        entries.extend(_flatten(item) if isinstance(item, list) else [item])
    return entries
