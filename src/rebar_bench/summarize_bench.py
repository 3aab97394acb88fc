"""Time to a summary of the 40-page sample PDF on a local model, with the chunks batched (every
request of the summary submitted at once) against one chunk at a time, alternated, medians of
the repeats; and the honest quality checks of each summary (pages cited share words with the
statement, the summary names the subject).

    python -m rebar_bench.summarize_bench --repeats 3 --json out.json

Run it under the exclusive CPU lock: `flock -x /tmp/rebar-cpu.lock python -m ...`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from dataclasses import replace

from rebar.documents.attribution import content_words
from rebar.documents.events import Summary
from rebar.documents.extract import read_document
from rebar.documents.generator import EngineGenerator
from rebar.documents.model import Document, DocumentLimits
from rebar.documents.summarize import SummaryOptions, summarize
from rebar.engine.async_engine import AsyncEngine
from rebar.llm import LLM
from rebar_bench.sample_document import PAGES, SUBJECT, sample_pdf

LIMITS = DocumentLimits(max_bytes=2**24, max_pages=100)


async def _timed(
    document: Document, generator: EngineGenerator, options: SummaryOptions
) -> tuple[float, Summary]:
    started = time.perf_counter()
    summary = None
    async for event in summarize(document, generator, options):
        if isinstance(event, Summary):
            summary = event
    assert summary is not None
    return time.perf_counter() - started, summary


def quality(summary: Summary) -> dict:
    """Cited pages that share no content word with their statement (should be none), statements
    with a page, and whether the subject is named."""
    statements = [s for section in summary.sections for s in section.statements]
    wrong = [
        (s.text, page)
        for s in statements
        for page in s.pages
        if not content_words(s.text) & content_words(PAGES[page - 1])
    ]
    return {
        "statements": len(statements),
        "with_pages": sum(1 for s in statements if s.pages),
        "wrong_citations": len(wrong),
        "mentions_subject": SUBJECT.rstrip("s") in summary.render().lower(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-chunk-tokens", type=int, default=SummaryOptions.max_chunk_tokens)
    parser.add_argument("--parallel", type=int, default=SummaryOptions.max_parallel_requests)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    document = read_document("sample.pdf", sample_pdf(), LIMITS)
    # No prefix cache: every run prefills its chunks from scratch, as a new document would.
    llm = LLM(args.model, max_model_len=4096, enable_prefix_caching=False)
    assert llm.engine is not None
    results = asyncio.run(_measure(document, llm, args))
    print(json.dumps(results, indent=2))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump(results, out, indent=2)


async def _measure(document: Document, llm: LLM, args: argparse.Namespace) -> dict:
    assert llm.engine is not None
    front = AsyncEngine(llm.engine)
    generator = EngineGenerator(front, llm, "bench")
    batched = SummaryOptions(
        max_chunk_tokens=args.max_chunk_tokens, max_parallel_requests=args.parallel
    )
    modes = {"batched": batched, "one_at_a_time": replace(batched, max_parallel_requests=1)}
    seconds: dict[str, list[float]] = {mode: [] for mode in modes}
    last: dict[str, Summary] = {}
    try:
        warm_up = read_document("warm.txt", b"Bees make honey.\n\nWasps do not.", LIMITS)
        await _timed(warm_up, generator, batched)  # kernels built, first allocations made
        for _ in range(args.repeats):
            for mode, options in modes.items():
                elapsed, last[mode] = await _timed(document, generator, options)
                seconds[mode].append(round(elapsed, 2))
    finally:
        front.shutdown()
    medians = {mode: statistics.median(values) for mode, values in seconds.items()}
    return {
        "pages": document.num_pages,
        "chunks": last["batched"].num_chunks,
        "requests": last["batched"].num_requests,
        "seconds": seconds,
        "median_s": medians,
        "speedup": round(medians["one_at_a_time"] / medians["batched"], 2),
        "quality": {mode: quality(summary) for mode, summary in last.items()},
        "summary": last["batched"].render(),
    }


if __name__ == "__main__":
    main()
