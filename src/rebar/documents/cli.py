"""`rebar summarize FILE`: a progress bar over the chunks on stderr, the summary streamed to
stdout statement by statement with its pages, Ctrl-C cancels every request and exits 130."""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rebar.documents.prompts import STYLES


def add_summarize_parser(commands: Any, add_model_args: Callable[..., None]) -> None:
    summarize_parser = commands.add_parser(
        "summarize",
        help="summarise a document (PDF, Markdown, text, HTML, DOCX) with a local model",
    )
    add_model_args(summarize_parser)
    summarize_parser.add_argument("file", type=Path, help="the document to summarise")
    summarize_parser.add_argument(
        "--style", choices=STYLES, default="abstract", help="abstract, key points or per section"
    )
    summarize_parser.set_defaults(handler=cmd_summarize)


def cmd_summarize(args: argparse.Namespace) -> int:
    # Imported here: every other command starts without torch, pypdf or python-docx.
    from rebar.config.flags import settings_from_flags
    from rebar.documents.cache import FolderCache
    from rebar.documents.extract import read_path
    from rebar.documents.generator import EngineGenerator
    from rebar.documents.options import document_limits, summary_options
    from rebar.documents.output import write_summary
    from rebar.engine.async_engine import AsyncEngine
    from rebar.llm import LLM

    settings = settings_from_flags(args)
    docs = settings.documents
    document = read_path(args.file, document_limits(docs))  # refused before the (slow) load
    llm = LLM.from_settings(args.model, settings)
    if llm.engine is None:
        raise llm.not_a_decoder()
    front = AsyncEngine(llm.engine)
    generator = EngineGenerator(front, llm, model_version(llm.loaded.checkpoint.path, llm.dtype))
    cache = FolderCache(docs.cache_dir) if docs.cache_dir is not None else None
    options = summary_options(docs, args.style)
    try:
        asyncio.run(write_summary(document, generator, options, cache, sys.stdout, sys.stderr))
    except KeyboardInterrupt:
        print("\ncancelled: every request of the summary was aborted", file=sys.stderr)
        return 130
    finally:
        front.shutdown()
    return 0


def model_version(path: Path, dtype: object) -> str:
    """The model file (or folder) as it is now: its path, size and modification time, and the
    dtype it runs in. A changed file is a new version."""
    stat = path.stat()
    text = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{dtype}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]
