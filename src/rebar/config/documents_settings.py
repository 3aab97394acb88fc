"""The `[documents]` section: which documents may be summarised, and how summaries are made."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import Field, field_validator

from rebar.config.base import Section, Unsettable


class DocumentsSettings(Section):
    """Bounds on documents, the sizes of a summary's requests, and where summaries are cached."""

    max_bytes: int = Field(
        20 * 2**20, ge=1024, description="Largest document file, in bytes (uploads too)."
    )
    max_pages: int = Field(500, ge=1, description="Most pages a document may have.")
    folder: Annotated[Path | None, Unsettable] = Field(
        None,
        description="The folder POST /v1/documents/summarize may read paths under; unset: none.",
    )
    max_chunk_tokens: int = Field(
        1024,
        ge=64,
        description="Largest chunk of document text per request (less if the context is smaller).",
    )
    summary_tokens: int = Field(
        128, ge=16, description="Longest summary of one chunk, or of a group of summaries."
    )
    final_tokens: int = Field(256, ge=16, description="Longest final summary (of each section).")
    max_parallel_requests: int = Field(
        16, ge=1, description="Requests of one summary running at once (1: one chunk at a time)."
    )
    cache_entries: int = Field(
        64, ge=0, description="Summaries the server keeps in memory; 0: none."
    )
    cache_dir: Annotated[Path | None, Unsettable] = Field(
        Path("~/.cache/rebar/summaries"),
        description="Where `rebar summarize` keeps summaries; unset: not kept.",
        validate_default=True,  # the default's ~ expanded as a configured one is
    )

    @field_validator("folder", "cache_dir")
    @classmethod
    def _expand_user(cls, path: Path | None) -> Path | None:
        return path.expanduser() if path is not None else None
