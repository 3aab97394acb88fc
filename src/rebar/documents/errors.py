"""Typed errors for documents that cannot be read: each names the problem, and the HTTP edge maps
each class to one status code (`rebar.server.errors.STATUS`)."""

from __future__ import annotations

from rebar.errors import RebarError


class DocumentError(RebarError):
    """A document rebar cannot summarise; the message says why, naming the file."""


class UnsupportedDocument(DocumentError):
    """A file type rebar does not read (an image, a spreadsheet, unknown binary data)."""


class EncryptedDocument(DocumentError):
    """A password-protected file: its text cannot be read without the password."""


class NoTextLayer(DocumentError):
    """A PDF whose pages carry no text (a scan): rebar does no OCR."""


class EmptyDocument(DocumentError):
    """A file with no text at all."""


class DocumentTooLarge(DocumentError):
    """A file past the configured byte or page bound (`documents.max_bytes`, `max_pages`)."""


class MalformedDocument(DocumentError):
    """A file that claims a format but is not valid in it (truncated, corrupt, wrong encoding)."""


class DocumentNotAllowed(DocumentError):
    """A path outside the folder documents may be read from, or no such folder configured."""


class DocumentNotFound(DocumentError):
    """A path under the allowed folder that names no readable file."""
