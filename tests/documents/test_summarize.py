"""The summariser on a stand-in model: one request when the document fits, chunks submitted
together and combined level by level when it does not, statements carrying the pages they came
from, styles, the cache, errors and cancellation."""

from __future__ import annotations

import asyncio

import pytest
from tests.documents.fake_model import FakeModel

from rebar.documents.attribution import Attributor, content_words
from rebar.documents.cache import FolderCache, MemoryCache
from rebar.documents.chunks import split_blocks
from rebar.documents.events import Planned, Progress, SectionStart, StatementWritten, Summary
from rebar.documents.extract import read_document
from rebar.documents.model import Document, DocumentLimits
from rebar.documents.statements import StatementSplitter, split_statements
from rebar.documents.summarize import ContextTooSmall, SummaryOptions, summarize

LIMITS = DocumentLimits(max_bytes=2**20, max_pages=100)
TOPICS = [
    "lighthouse keepers",
    "copper mining",
    "orchard grafting",
    "glacier melt",
    "violin making",
    "tide pools",
    "printing presses",
    "falcon training",
]


def topic_document(num_pages: int, words_per_page: int = 60) -> Document:
    """Markdown with a heading every four pages and one topic per page (pages on form feeds)."""
    pages = []
    for page in range(num_pages):
        topic = TOPICS[page % len(TOPICS)]
        first = f"Page {page + 1} explains {topic} with care."
        filler = " ".join(f"{topic.split()[0]}{i}" for i in range(words_per_page))
        heading = f"# Part {page // 4 + 1}\n\n" if page % 4 == 0 else ""
        pages.append(f"{heading}{first} {filler}.\n\nA second paragraph on {topic} follows here.")
    return read_document("topics.md", "\n\f".join(pages).encode(), LIMITS)


def run(document: Document, model: FakeModel, cache=None, **options) -> list:
    async def collect() -> list:
        return [e async for e in summarize(document, model, SummaryOptions(**options), cache)]

    return asyncio.run(collect())


def test_a_document_that_fits_is_one_request() -> None:
    model = FakeModel()
    events = run(topic_document(2), model)
    summary = events[-1]
    assert isinstance(summary, Summary) and summary.num_requests == 1 and summary.num_chunks == 1
    assert isinstance(events[0], Planned) and events[0].num_chunks == 1
    assert [e.stage for e in events if isinstance(e, Progress)] == ["final"]
    assert "lighthouse keepers" in model.started[0] and "copper mining" in model.started[0]


def test_a_long_document_is_chunked_batched_and_combined() -> None:
    model = FakeModel()
    document = topic_document(48)
    events = run(
        document,
        model,
        max_chunk_tokens=300,
        summary_tokens=100,
        final_tokens=100,
        max_parallel_requests=64,
    )
    planned, summary = events[0], events[-1]
    assert planned.num_chunks > 4
    stages = [(e.stage, e.level) for e in events if isinstance(e, Progress)]
    assert stages.count(("chunk", 0)) == planned.num_chunks
    assert any(stage == "combine" for stage, _ in stages), "the summaries needed combining"
    assert stages[-1] == ("final", 0)
    # every chunk was in flight at once: the engine gets them as one batch
    assert model.most_in_flight >= planned.num_chunks
    assert summary.num_requests == len(model.started) == len(stages)
    # every chunk request stayed within the budget
    assert all(model.count_tokens(p) <= 300 + 40 for p in model.started)


@pytest.mark.parametrize("bound", [1, 3])
def test_parallel_requests_bounded(bound: int) -> None:
    model = FakeModel()
    run(
        topic_document(24),
        model,
        max_chunk_tokens=400,
        summary_tokens=100,
        final_tokens=100,
        max_parallel_requests=bound,
    )
    assert model.most_in_flight == bound


def test_statements_cite_pages_that_share_their_words() -> None:
    document = topic_document(16)
    events = run(document, FakeModel(), max_chunk_tokens=300, summary_tokens=90, final_tokens=200)
    statements = [e.statement for e in events if isinstance(e, StatementWritten)]
    assert statements and all(s.pages for s in statements)
    for statement in statements:
        for page in statement.pages:
            assert content_words(statement.text) & content_words(document.page_text(page))
    summary = events[-1]
    assert [s for sec in summary.sections for s in sec.statements] == statements
    assert "[p. " in summary.render() or "[pp. " in summary.render()


def test_statements_stream_before_the_summary_ends() -> None:
    events = run(topic_document(3), FakeModel())
    kinds = [type(e).__name__ for e in events]
    assert kinds.index("StatementWritten") < kinds.index("Summary") == len(kinds) - 1


def test_per_section_summaries_in_document_order() -> None:
    document = topic_document(12)
    events = run(
        document,
        FakeModel(),
        style="per_section",
        max_chunk_tokens=400,
        summary_tokens=60,
        final_tokens=100,
    )
    starts = [e for e in events if isinstance(e, SectionStart)]
    assert [s.title for s in starts] == ["Part 1", "Part 2", "Part 3"]
    assert starts[1].pages == (5, 6, 7, 8)
    summary = events[-1]
    assert [s.title for s in summary.sections] == ["Part 1", "Part 2", "Part 3"]
    for section in summary.sections:
        assert all(set(s.pages) <= set(section.pages) for s in section.statements)
    assert summary.render().startswith("## Part 1 (pp. 1, 2, 3, 4)")


def test_key_points_render_as_a_list() -> None:
    summary = run(topic_document(2), FakeModel(), style="key_points")[-1]
    assert all(line.startswith("- ") for line in summary.render().strip().splitlines())


def test_chunks_follow_sections_and_budget() -> None:
    document = topic_document(12)
    chunks = split_blocks(document.blocks, 200, lambda t: len(t.split()), by_section=True)
    assert all(len({b.section for b in c.blocks}) == 1 for c in chunks)
    assert all(sum(len(b.text.split()) + 2 for b in c.blocks) <= 200 for c in chunks)
    assert [b for c in chunks for b in c.blocks] == list(document.blocks)


def test_a_block_longer_than_a_chunk_is_cut() -> None:
    document = read_document(
        "long.txt", ("word " * 1000 + ". Next sentence here.").encode(), LIMITS
    )
    chunks = split_blocks(document.blocks, 100, lambda t: len(t.split()))
    assert len(chunks) >= 10 and all(len(c.text.split()) <= 100 for c in chunks)
    assert sum(len(c.text.split()) for c in chunks) == 1004


def test_cached_per_document_model_and_style(tmp_path) -> None:
    document = topic_document(3)
    for cache in (MemoryCache(4), FolderCache(tmp_path / "summaries")):
        model = FakeModel()
        first = run(document, model, cache)[-1]
        again = run(document, model, cache)
        assert len(model.started) == 1, "the second summary came from the cache"
        assert again[0].cached and again[-1].cached
        assert again[-1].sections == first.sections
        run(document, model, cache, style="key_points")
        assert len(model.started) == 2, "another style is another summary"
        other = FakeModel()
        other.version = "fake-v2"
        run(document, other, cache)
        assert len(other.started) == 1, "another model version is another summary"


def test_memory_cache_keeps_the_most_recent() -> None:
    cache = MemoryCache(1)
    model = FakeModel()
    run(topic_document(2), model, cache)
    run(topic_document(3), model, cache)
    run(topic_document(2), model, cache)
    assert len(model.started) == 3


def test_a_context_too_small_is_refused_before_any_request() -> None:
    model = FakeModel(context_tokens=200)
    with pytest.raises(ContextTooSmall, match="context of 200 tokens"):
        run(topic_document(2), model)
    assert model.started == []


def test_a_failing_request_fails_the_summary_and_cancels_the_rest() -> None:
    model = FakeModel(fail_on="copper")
    with pytest.raises(RuntimeError, match="the engine broke"):
        run(topic_document(24), model, max_chunk_tokens=200, summary_tokens=60, final_tokens=60)
    assert model.in_flight == 0


def test_closing_the_summary_cancels_every_request() -> None:
    model = FakeModel(hold=True)

    async def start_then_leave() -> None:
        events = summarize(
            topic_document(24),
            model,
            SummaryOptions(max_chunk_tokens=200, summary_tokens=60, final_tokens=60),
        )
        assert isinstance(await anext(events), Planned)
        while model.in_flight < 5:
            await asyncio.sleep(0)
        await events.aclose()

    asyncio.run(start_then_leave())
    assert model.cancelled >= 5 and model.in_flight == 0 and model.finished == 0


def test_statements_are_cut_as_they_complete() -> None:
    splitter = StatementSplitter()
    assert splitter.feed("Bees make hon") == []
    assert splitter.feed("ey. Wasps do not") == ["Bees make honey."]
    assert splitter.feed(".\nThe key points:\n- **Queens** lay eggs.\n1. Drones mate\n") == [
        "Wasps do not.",
        "Queens lay eggs.",
        "Drones mate",
    ]
    assert splitter.close() == []
    assert split_statements("In 2020. The end e.g. here? Yes") == [
        "In 2020. The end e.g. here?",
        "Yes",
    ]


def test_attribution_needs_shared_content_words() -> None:
    document = read_document(
        "a.txt", b"Queens lay eggs in spring.\f Drones mate with queens.\fWax builds comb.", LIMITS
    )
    attributor = Attributor(document.blocks)
    assert attributor.statement("The queens lay many eggs.", [1, 2, 3]).pages == (1,)
    # one shared word ("queens") is not enough for a statement of four content words
    assert attributor.statement("The queens lay many eggs.", [2, 3]).pages == ()
    assert attributor.statement("Drones and queens mate.", [1, 2, 3]).pages == (2,)
    assert attributor.statement("Wax.", [1, 2, 3]).pages == (3,)
    assert attributor.statement("The weather was pleasant.", [1, 2, 3]).pages == ()
