"""The `[documents]` settings as the plain values extraction and summaries take."""

from __future__ import annotations

from rebar.config import DocumentsSettings
from rebar.documents.model import DocumentLimits
from rebar.documents.prompts import Style
from rebar.documents.summarize import SummaryOptions


def document_limits(settings: DocumentsSettings) -> DocumentLimits:
    return DocumentLimits(max_bytes=settings.max_bytes, max_pages=settings.max_pages)


def summary_options(settings: DocumentsSettings, style: Style) -> SummaryOptions:
    return SummaryOptions(
        style=style,
        max_chunk_tokens=settings.max_chunk_tokens,
        summary_tokens=settings.summary_tokens,
        final_tokens=settings.final_tokens,
        max_parallel_requests=settings.max_parallel_requests,
    )
