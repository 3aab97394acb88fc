"""Summaries of any length: a document that fits the model's context is summarised in one request;
a longer one is split on its structure into chunks, the chunks are summarised concurrently (all
submitted at once, so the engine batches them), and the summaries are combined level by level until
what is left fits one final request in the chosen style. Each statement of the result carries the
pages it came from.

`summarize` is an async iterator of events (`rebar.documents.events`); closing it early (Ctrl-C, a
client that left) cancels every request still running, which aborts it in the engine.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

from rebar.documents.cache import SummaryCache
from rebar.documents.chunks import Chunk, split_blocks
from rebar.documents.errors import DocumentError
from rebar.documents.events import (
    Event,
    Planned,
    SectionStart,
    StatementWritten,
    Summary,
)
from rebar.documents.generator import Generator
from rebar.documents.model import Document
from rebar.documents.prompts import Style, longest_instruction, messages
from rebar.documents.steps import SummaryRun


class ContextTooSmall(DocumentError):
    """The model's context window leaves no room for a chunk and its summary."""


@dataclass(frozen=True)
class SummaryOptions:
    """How a summary is made: its style, the largest chunk (tokens; smaller when the model's context
    is), the tokens of each intermediate and of the final summary, and how many requests run at
    once (1: one chunk at a time)."""

    style: Style = "abstract"
    max_chunk_tokens: int = 1024
    summary_tokens: int = 128
    final_tokens: int = 256
    max_parallel_requests: int = 16


def chunk_budget(generator: Generator, options: SummaryOptions) -> int:
    """Tokens of document text one request may carry: the context less the instruction, the chat
    template and the longest answer, at most `max_chunk_tokens`."""
    overhead = generator.prompt_tokens(messages(longest_instruction(), ""))
    room = generator.context_tokens - overhead - options.final_tokens
    budget = min(options.max_chunk_tokens, room)
    if budget < 3 * options.summary_tokens:
        raise ContextTooSmall(
            f"a context of {generator.context_tokens} tokens leaves {room} for document text; "
            f"summaries of {options.summary_tokens} tokens need at least "
            f"{3 * options.summary_tokens}"
        )
    return budget


def cache_key(document: Document, generator: Generator, options: SummaryOptions) -> str:
    fields = (
        document.sha256,
        generator.version,
        options.style,
        options.max_chunk_tokens,
        options.summary_tokens,
        options.final_tokens,
    )
    return hashlib.sha256("|".join(map(str, fields)).encode()).hexdigest()


async def summarize(
    document: Document,
    generator: Generator,
    options: SummaryOptions,
    cache: SummaryCache | None = None,
) -> AsyncIterator[Event]:
    """Events of the summary of `document`; the last is the `Summary`. Raises ContextTooSmall
    before any request, SummaryFailed if the engine fails."""
    budget = chunk_budget(generator, options)
    key = cache_key(document, generator, options)
    cached = cache.get(key) if cache is not None else None
    if cached is not None:
        for event in _replay(cached):
            yield event
        return
    by_section = options.style == "per_section"
    chunks = split_blocks(document.blocks, budget, generator.count_tokens, by_section)
    groups = _section_groups(chunks) if by_section else [chunks]
    run = SummaryRun(document, generator, options, budget)
    run.emit(Planned(len(chunks), budget, len(groups)))
    task = asyncio.create_task(run.summarise(groups))
    try:
        while True:
            event = await run.next_event()
            yield event
            if isinstance(event, Summary):
                break
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    if cache is not None:
        cache.put(key, event)


def _section_groups(chunks: list[Chunk]) -> list[list[Chunk]]:
    groups: list[list[Chunk]] = []
    for chunk in chunks:
        if groups and groups[-1][-1].section == chunk.section:
            groups[-1].append(chunk)
        else:
            groups.append([chunk])
    return groups


def _replay(summary: Summary) -> list[Event]:
    events: list[Event] = [Planned(summary.num_chunks, 0, len(summary.sections), cached=True)]
    for section in summary.sections:
        if section.title is not None:
            events.append(SectionStart(section.title, section.pages))
        events.extend(StatementWritten(s) for s in section.statements)
    events.append(
        Summary(summary.style, summary.sections, summary.num_chunks, summary.num_requests, True)
    )
    return events
