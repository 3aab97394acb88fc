"""What `rebar summarize` writes: the summary on stdout exactly as the finished summary renders it
(statements with their pages, sections with theirs), a progress bar line per request on stderr."""

from __future__ import annotations

import asyncio
import io

from tests.documents.fake_model import FakeModel
from tests.documents.test_summarize import topic_document

from rebar.documents.extract import read_document
from rebar.documents.model import DocumentLimits
from rebar.documents.output import write_summary
from rebar.documents.summarize import SummaryOptions


def write(style: str, num_pages: int) -> tuple[str, str, str]:
    out, err = io.StringIO(), io.StringIO()
    options = SummaryOptions(style=style, max_chunk_tokens=300, summary_tokens=60, final_tokens=100)
    summary = asyncio.run(
        write_summary(topic_document(num_pages), FakeModel(), options, None, out, err)
    )
    return out.getvalue(), err.getvalue(), summary.render()


def test_stdout_is_the_rendered_summary() -> None:
    for style in ("abstract", "key_points", "per_section"):
        out, _, rendered = write(style, 12)
        assert out == rendered
        assert "[p. " in out or "[pp. " in out


def test_progress_lines_on_stderr() -> None:
    _, err, _ = write("abstract", 12)
    lines = err.splitlines()
    assert lines[0].startswith("topics.md: 12 page(s), in ") and "chunk(s)" in lines[0]
    num_chunks = int(lines[0].split("in ")[1].split(" ")[0])
    chunk_lines = [line for line in lines if "] chunk " in line]
    assert len(chunk_lines) == num_chunks
    assert (
        chunk_lines[-1].startswith("[" + "#" * 24 + "]")
        and f"chunk {num_chunks}/{num_chunks}" in chunk_lines[-1]
    )
    assert lines[-1].startswith("[" + "#" * 24 + "] final 1/1")


def test_a_text_file_summarised_whole_is_one_request() -> None:
    document = read_document(
        "note.txt", b"Bees make honey.\n\nWasps do not.", DocumentLimits(4096, 5)
    )
    out, err = io.StringIO(), io.StringIO()
    model = FakeModel()
    asyncio.run(write_summary(document, model, SummaryOptions(), None, out, err))
    assert out.getvalue() == "Bees make honey. [p. 1]\nWasps do not. [p. 1]\n"
    assert len(model.started) == 1
