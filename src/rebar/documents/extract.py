"""Reading a document: its format from the file name (or its first bytes), its text extracted
locally, the configured bounds enforced before any parsing."""

from __future__ import annotations

import hashlib
from pathlib import Path, PurePath

from rebar.documents.errors import (
    DocumentNotAllowed,
    DocumentNotFound,
    DocumentTooLarge,
    EmptyDocument,
    EncryptedDocument,
    UnsupportedDocument,
)
from rebar.documents.markup import decode_text, html_blocks, markdown_blocks, text_blocks
from rebar.documents.model import Block, Document, DocumentLimits, Kind

SUFFIXES: dict[str, Kind] = {
    ".pdf": "pdf",
    ".md": "markdown",
    ".markdown": "markdown",
    ".txt": "text",
    ".text": "text",
    ".html": "html",
    ".htm": "html",
    ".docx": "docx",
}
# An encrypted Office file is an OLE compound file, not a zip.
_OLE_MAGIC = b"\xd0\xcf\x11\xe0\xa1\xb1\x1a\xe1"


def read_document(name: str, data: bytes, limits: DocumentLimits) -> Document:
    """The document in `data` (`name` is the file's name: its suffix says the format).

    Raises a DocumentError subclass naming the problem: UnsupportedDocument, EncryptedDocument,
    NoTextLayer, EmptyDocument, DocumentTooLarge or MalformedDocument.
    """
    name = PurePath(name).name or "document"
    if len(data) > limits.max_bytes:
        raise DocumentTooLarge(
            f"{name}: {len(data)} bytes, more than the {limits.max_bytes} allowed "
            "(documents.max_bytes)"
        )
    if not data.strip():
        raise EmptyDocument(f"{name}: the file is empty")
    kind = document_kind(name, data)
    blocks, num_pages = _blocks(kind, name, data, limits)
    if not blocks:
        raise EmptyDocument(f"{name}: the file has no text")
    return Document(name, kind, tuple(blocks), num_pages, hashlib.sha256(data).hexdigest())


def document_kind(name: str, data: bytes) -> Kind:
    """The format by suffix; a file without a known suffix by its first bytes."""
    suffix = PurePath(name).suffix.lower()
    if data.startswith(_OLE_MAGIC):
        raise EncryptedDocument(
            f"{name}: a password-protected (or legacy binary) Office file; save it as DOCX "
            "without a password"
        )
    if suffix in SUFFIXES:
        return SUFFIXES[suffix]
    if suffix:
        known = ", ".join(sorted(SUFFIXES))
        raise UnsupportedDocument(f"{name}: {suffix} files are not supported (known: {known})")
    head = data[:1024].lstrip().lower()
    if head.startswith(b"%pdf-"):
        return "pdf"
    if head.startswith(b"pk\x03\x04"):
        return "docx"
    if head.startswith((b"<!doctype html", b"<html")):
        return "html"
    if b"\x00" in data[:8192]:
        raise UnsupportedDocument(f"{name}: binary data of an unknown format")
    return "text"


def _blocks(kind: Kind, name: str, data: bytes, limits: DocumentLimits) -> tuple[list[Block], int]:
    # The PDF and DOCX readers (pypdf, python-docx) are imported on first use, not at a server's
    # start.
    if kind == "pdf":
        from rebar.documents.pdf import pdf_blocks

        return pdf_blocks(name, data, limits)
    if kind == "docx":
        from rebar.documents.docx import docx_blocks

        return docx_blocks(name, data, limits)
    text = decode_text(name, data)
    if kind == "html":
        return html_blocks(text)
    blocks, num_pages = markdown_blocks(text) if kind == "markdown" else text_blocks(text)
    if num_pages > limits.max_pages:
        raise DocumentTooLarge(
            f"{name}: {num_pages} pages, more than the {limits.max_pages} allowed "
            "(documents.max_pages)"
        )
    return blocks, num_pages


def read_path(path: Path, limits: DocumentLimits) -> Document:
    """The document at `path` (checked against `max_bytes` before it is read)."""
    try:
        size = path.stat().st_size
        if size > limits.max_bytes:
            raise DocumentTooLarge(
                f"{path.name}: {size} bytes, more than the {limits.max_bytes} allowed "
                "(documents.max_bytes)"
            )
        if not path.is_file():
            raise DocumentNotFound(f"{path.name}: not a file")
        data = path.read_bytes()
    except OSError as exc:
        raise DocumentNotFound(f"{path}: {exc.strerror or exc}") from None
    return read_document(path.name, data, limits)


def resolve_under(folder: Path | None, relative: str) -> Path:
    """`relative` inside `folder`, refusing anything that resolves outside it (`..`, absolute
    paths, symbolic links out)."""
    if folder is None:
        raise DocumentNotAllowed(
            "reading documents by path is off: set documents.folder to the folder they may be "
            "read from"
        )
    root = folder.resolve()
    candidate = (root / relative).resolve()
    if not candidate.is_relative_to(root) or candidate == root:
        raise DocumentNotAllowed(f"{relative!r} is outside the documents folder")
    return candidate
