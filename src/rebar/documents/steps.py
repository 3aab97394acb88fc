"""One summary being made: the requests of each step (chunk, combine, final), run concurrently up
to a bound, their progress and statements reported as events on one queue."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator, Coroutine, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rebar.documents.attribution import Attributor, Statement
from rebar.documents.chunks import Chunk
from rebar.documents.events import (
    Event,
    Progress,
    SectionStart,
    Stage,
    StatementWritten,
    Summary,
    SummarySection,
)
from rebar.documents.generator import Generator
from rebar.documents.model import Document
from rebar.documents.prompts import CHUNK, COMBINE, FINAL, messages
from rebar.documents.statements import StatementSplitter

if TYPE_CHECKING:
    from rebar.documents.summarize import SummaryOptions


@dataclass(frozen=True)
class Part:
    """Text to summarise further and the pages it stands for."""

    text: str
    pages: tuple[int, ...]


async def _all(requests: Iterable[Coroutine[Any, Any, Part]]) -> list[Part]:
    """Every request submitted at once (the engine batches them); one failing cancels the rest."""
    async with asyncio.TaskGroup() as running:
        tasks = [running.create_task(request) for request in requests]
    return [task.result() for task in tasks]


def _pages(parts: list[Part]) -> tuple[int, ...]:
    return tuple(sorted({p for part in parts for p in part.pages}))


class SummaryRun:
    """The requests of one summary. `summarise` puts every event on the queue `next_event` reads;
    an error ends the run and is raised by `next_event`."""

    def __init__(
        self, document: Document, generator: Generator, options: SummaryOptions, budget: int
    ) -> None:
        self.document, self.generator, self.options, self.budget = (
            document,
            generator,
            options,
            budget,
        )
        self.attributor = Attributor(document.blocks)
        self._events: asyncio.Queue[Event | BaseException] = asyncio.Queue()
        self._slots = asyncio.Semaphore(options.max_parallel_requests)
        self._planned: Counter[tuple[Stage, int]] = Counter()
        self._done: Counter[tuple[Stage, int]] = Counter()
        self.num_requests = 0
        self.num_chunks = 0
        self.num_sections = 0

    def emit(self, event: Event | Exception) -> None:
        self._events.put_nowait(event)

    async def next_event(self) -> Event:
        event = await self._events.get()
        if isinstance(event, BaseException):
            raise event
        return event

    async def summarise(self, groups: list[list[Chunk]]) -> None:
        """Every group (the whole document, or one per section) summarised concurrently; the
        sections reported in document order."""
        self.num_chunks = sum(len(g) for g in groups)
        self.num_sections = len(groups)
        try:
            if self.options.style != "per_section":
                sections = [await self._group(groups[0], stream=True)]
            else:
                sections = await self._sections(groups)
            self.emit(
                Summary(self.options.style, tuple(sections), self.num_chunks, self.num_requests)
            )
        except Exception as exc:  # handed to the reader, which raises it
            while isinstance(exc, ExceptionGroup):
                exc = exc.exceptions[0]
            self.emit(exc)

    async def _sections(self, groups: list[list[Chunk]]) -> list[SummarySection]:
        """All sections at once (one failing cancels the rest), reported in document order."""
        sections = []
        async with asyncio.TaskGroup() as running:
            tasks = [running.create_task(self._group(g, stream=False)) for g in groups]
            for task in tasks:
                section = await task
                self.emit(SectionStart(section.title or "", section.pages))
                for statement in section.statements:
                    self.emit(StatementWritten(statement))
                sections.append(section)
        return sections

    async def _group(self, chunks: list[Chunk], stream: bool) -> SummarySection:
        parts = await self._condense(chunks)
        style = self.options.style
        text = "\n\n".join(p.text for p in parts)
        statements = await self._final(FINAL[style], text, _pages(parts), stream)
        title = chunks[0].section or f"Pages {chunks[0].pages[0]}-{chunks[-1].pages[-1]}"
        return SummarySection(
            title if style == "per_section" else None, _pages(parts), tuple(statements)
        )

    async def _condense(self, chunks: list[Chunk]) -> list[Part]:
        """Chunk summaries combined level by level until they fit one request (a single chunk is
        its own text: the document fits the context)."""
        if len(chunks) == 1:
            return [Part(chunks[0].text, chunks[0].pages)]
        parts = await _all(
            self._summarise(CHUNK, [Part(c.text, c.pages)], "chunk", 0) for c in chunks
        )
        level = 1
        while self._tokens(parts) > self.budget:
            groups = self._pack(parts)
            parts = await _all(self._summarise(COMBINE, g, "combine", level) for g in groups)
            level += 1
        return parts

    def _tokens(self, parts: list[Part]) -> int:
        return self.generator.count_tokens("\n\n".join(p.text for p in parts))

    def _pack(self, parts: list[Part]) -> list[list[Part]]:
        """Consecutive parts in groups that fit the budget, at least two to a group so that every
        level shrinks."""
        groups: list[list[Part]] = [[]]
        for part in parts:
            group = groups[-1]
            if len(group) >= 2 and self._tokens([*group, part]) > self.budget:
                groups.append([part])
            else:
                group.append(part)
        return groups

    async def _summarise(
        self, instruction: str, parts: list[Part], stage: Stage, level: int
    ) -> Part:
        self._planned[stage, level] += 1
        text = "\n\n".join(p.text for p in parts)
        answer = "".join(
            [d async for d in self._ask(instruction, text, self.options.summary_tokens)]
        )
        self._report(stage, level, _pages(parts))
        return Part(answer.strip(), _pages(parts))

    async def _final(
        self, instruction: str, text: str, pages: tuple[int, ...], stream: bool
    ) -> list[Statement]:
        self._planned["final", 0] += 1
        splitter = StatementSplitter()
        statements: list[Statement] = []

        def written(texts: list[str]) -> None:
            for found in texts:
                statement = self.attributor.statement(found, pages)
                statements.append(statement)
                if stream:
                    self.emit(StatementWritten(statement))

        async for delta in self._ask(instruction, text, self.options.final_tokens):
            written(splitter.feed(delta))
        written(splitter.close())
        self._report("final", 0, pages)
        return statements

    async def _ask(self, instruction: str, text: str, max_tokens: int) -> AsyncIterator[str]:
        async with self._slots:
            self.num_requests += 1
            async for delta in self.generator.stream(messages(instruction, text), max_tokens):
                yield delta

    def _report(self, stage: Stage, level: int, pages: tuple[int, ...]) -> None:
        self._done[stage, level] += 1
        done, total = self._done[stage, level], self._planned[stage, level]
        if stage == "chunk":
            total = self.num_chunks
        elif stage == "final":
            total = self.num_sections
        self.emit(Progress(stage, done, total, pages, level))
