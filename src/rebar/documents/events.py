"""What a running summary reports, in order: its plan, progress per finished request, each
statement as it is written (with its pages), and the whole summary at the end."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

from rebar.documents.attribution import Statement
from rebar.documents.prompts import Style

Stage = Literal["chunk", "combine", "final"]


@dataclass(frozen=True)
class Planned:
    """The document was split into `num_chunks` chunks of at most `chunk_tokens` tokens;
    `num_sections` is the number of summaries the style produces (1 but for per-section)."""

    num_chunks: int
    chunk_tokens: int
    num_sections: int
    cached: bool = False


@dataclass(frozen=True)
class Progress:
    """One request finished: `done` of `total` at this stage (and combining level)."""

    stage: Stage
    done: int
    total: int
    pages: tuple[int, ...]
    level: int = 0


@dataclass(frozen=True)
class SectionStart:
    """Per-section summaries: the statements that follow belong to this section."""

    title: str
    pages: tuple[int, ...]


@dataclass(frozen=True)
class StatementWritten:
    statement: Statement


@dataclass(frozen=True)
class SummarySection:
    """A section of the summary: a title (None for abstract and key points) and its statements."""

    title: str | None
    pages: tuple[int, ...]
    statements: tuple[Statement, ...]


@dataclass(frozen=True)
class Summary:
    """A finished summary: its style, its sections, and how many model requests it took."""

    style: Style
    sections: tuple[SummarySection, ...]
    num_chunks: int
    num_requests: int
    cached: bool = False

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> Summary:
        sections = tuple(
            SummarySection(
                s["title"],
                tuple(s["pages"]),
                tuple(Statement(t["text"], tuple(t["pages"])) for t in s["statements"]),
            )
            for s in data["sections"]
        )
        return cls(data["style"], sections, data["num_chunks"], data["num_requests"])

    def render(self) -> str:
        """The summary as text, each statement followed by its pages."""
        lines: list[str] = []
        for section in self.sections:
            if section.title is not None:
                lines.append(f"## {section.title} ({cite(section.pages)})")
            for statement in section.statements:
                lines.append(render_statement(statement, self.style))
            lines.append("")
        return "\n".join(lines).rstrip() + "\n"


def cite(pages: tuple[int, ...]) -> str:
    if not pages:
        return "no source found"
    return ("p. " if len(pages) == 1 else "pp. ") + ", ".join(str(p) for p in pages)


def render_statement(statement: Statement, style: Style) -> str:
    bullet = "- " if style == "key_points" else ""
    return f"{bullet}{statement.text} [{cite(statement.pages)}]"


Event = Planned | Progress | SectionStart | StatementWritten | Summary
