"""Finished summaries kept per (document hash, model version, style and sizes): in memory for the
server, in a folder for the command line (a summary of the same file is instant the second time)."""

from __future__ import annotations

import json
import os
import tempfile
from collections import OrderedDict
from pathlib import Path
from typing import Protocol

from rebar.documents.events import Summary


class SummaryCache(Protocol):
    def get(self, key: str) -> Summary | None: ...

    def put(self, key: str, summary: Summary) -> None: ...


class MemoryCache:
    """The `max_entries` most recently used summaries."""

    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[str, Summary] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str) -> Summary | None:
        summary = self._entries.get(key)
        if summary is not None:
            self._entries.move_to_end(key)
        return summary

    def put(self, key: str, summary: Summary) -> None:
        self._entries[key] = summary
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)


class FolderCache:
    """One JSON file per summary in `folder` (created on first write). An unreadable or damaged
    entry is a miss, never an error: the summary is made again."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def get(self, key: str) -> Summary | None:
        try:
            return Summary.from_json(json.loads((self.folder / f"{key}.json").read_text("utf-8")))
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def put(self, key: str, summary: Summary) -> None:
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            handle, temporary = tempfile.mkstemp(dir=self.folder, suffix=".tmp")
            with os.fdopen(handle, "w", encoding="utf-8") as out:
                json.dump(summary.to_json(), out)
            os.replace(temporary, self.folder / f"{key}.json")  # readers never see half a file
        except OSError:
            pass  # a read-only or full disk costs the next run a recomputation, nothing more
