"""A running summary written for a terminal: statements with their pages on one stream as they
are written, a progress bar line per finished request on another."""

from __future__ import annotations

from typing import TextIO

from rebar.documents.cache import SummaryCache
from rebar.documents.events import (
    Planned,
    Progress,
    SectionStart,
    StatementWritten,
    Summary,
    cite,
    render_statement,
)
from rebar.documents.generator import Generator
from rebar.documents.model import Document
from rebar.documents.summarize import SummaryOptions, summarize

BAR_WIDTH = 24


async def write_summary(
    document: Document,
    generator: Generator,
    options: SummaryOptions,
    cache: SummaryCache | None,
    out: TextIO,
    err: TextIO,
) -> Summary:
    """The summary's statements on `out` as they are written, its progress on `err`."""
    summary: Summary | None = None
    first_section = True
    async for event in summarize(document, generator, options, cache):
        if isinstance(event, Planned):
            what = "from the cache" if event.cached else f"in {event.num_chunks} chunk(s)"
            print(f"{document.name}: {document.num_pages} page(s), {what}", file=err)
        elif isinstance(event, Progress):
            print(progress_line(event), file=err)
        elif isinstance(event, SectionStart):
            if not first_section:
                out.write("\n")
            first_section = False
            out.write(f"## {event.title} ({cite(event.pages)})\n")
        elif isinstance(event, StatementWritten):
            out.write(render_statement(event.statement, options.style) + "\n")
        else:
            summary = event
        out.flush()
    assert summary is not None, "a summary ends with its Summary"
    return summary


def progress_line(event: Progress) -> str:
    filled = round(BAR_WIDTH * event.done / max(event.total, 1))
    bar = "#" * filled + "." * (BAR_WIDTH - filled)
    stage = f"combine (level {event.level})" if event.stage == "combine" else event.stage
    return f"[{bar}] {stage} {event.done}/{event.total} ({cite(event.pages)})"
