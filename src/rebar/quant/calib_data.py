"""Calibration (and evaluation) text from JSONL files: memory-mapped, indexed once, sampled
deterministically.

The file is never read into memory: it is `mmap`ed, and a line-offset index is built in one
streaming pass (a chunk at a time, so files larger than RAM work) and saved beside it as `FILE.idx`.
The index is itself memory-mapped and rebuilt only when the file's size or modification time
changes. A record is a zero-copy `memoryview` of its line until it is parsed. Lines that are not a
JSON object with a string under the text field are reported (file and line number) and skipped;
blank lines are ignored.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from rebar.errors import InvalidRequestError

logger = logging.getLogger("rebar.quant")

INDEX_SUFFIX = ".idx"
_INDEX_MAGIC = b"RBJSONL1"
_HEADER_WORDS = 3  # file size, mtime_ns, number of line starts
_SCAN_CHUNK_BYTES = 16 * 2**20


@dataclass(frozen=True)
class BadLine:
    line_number: int  # 1-based, as an editor shows it
    reason: str


class BadRecordError(ValueError):
    def __init__(self, line_number: int, reason: str) -> None:
        super().__init__(f"line {line_number}: {reason}")
        self.bad_line = BadLine(line_number, reason)


class JsonlDataset:
    """The lines of a JSONL file, by index; `text(i)` is the `text_field` of line i + 1.

    `len()` counts lines, blank ones included (they are skipped when texts are read). Use as a
    context manager, or call `close()`, to release the mappings.
    """

    def __init__(
        self, path: str | Path, text_field: str = "text", scan_chunk_bytes: int = _SCAN_CHUNK_BYTES
    ) -> None:
        self.path = Path(path)
        self.text_field = text_field
        if not self.path.is_file():
            raise InvalidRequestError(f"dataset {self.path} does not exist", "data")
        self.index_path = self.path.with_name(self.path.name + INDEX_SUFFIX)
        self.bad_lines: list[BadLine] = []
        stat = self.path.stat()
        self._size = stat.st_size
        self._file = open(self.path, "rb")  # noqa: SIM115 - held open for the mmap until close()
        # mmap cannot map an empty file; an empty dataset simply has no lines.
        self._data = (
            mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ) if self._size else b""
        )
        self._starts = self._open_index(stat.st_mtime_ns, scan_chunk_bytes)

    # ----- the index ----------------------------------------------------------------------
    def _open_index(self, mtime_ns: int, scan_chunk_bytes: int) -> np.ndarray:
        header = np.array([self._size, mtime_ns, 0], dtype=np.int64)
        if not self._index_is_current(header):
            self._write_index(header, scan_chunk_bytes)
        count = int(
            np.fromfile(
                self.index_path, dtype=np.int64, count=_HEADER_WORDS, offset=len(_INDEX_MAGIC)
            )[2]
        )
        offset = len(_INDEX_MAGIC) + 8 * _HEADER_WORDS
        return (
            np.memmap(self.index_path, dtype=np.int64, mode="r", offset=offset, shape=(count,))
            if count
            else np.zeros(0, np.int64)
        )

    def _index_is_current(self, header: np.ndarray) -> bool:
        try:
            with open(self.index_path, "rb") as index:
                magic = index.read(len(_INDEX_MAGIC))
                stored = np.frombuffer(index.read(8 * _HEADER_WORDS), dtype=np.int64)
            index_bytes = self.index_path.stat().st_size
        except OSError:
            return False
        if (
            magic != _INDEX_MAGIC
            or len(stored) != _HEADER_WORDS
            or not (stored[:2] == header[:2]).all()
        ):
            return False
        return index_bytes == len(_INDEX_MAGIC) + 8 * (
            _HEADER_WORDS + int(stored[2])
        )  # not truncated

    def _write_index(self, header: np.ndarray, scan_chunk_bytes: int) -> None:
        """Stream the file once, writing the offset where each line starts (plus the end of the
        file)."""
        temporary = self.index_path.with_name(self.index_path.name + f".tmp{os.getpid()}")
        count = 0
        try:
            with open(temporary, "wb") as index:
                index.write(_INDEX_MAGIC)
                index.write(header.tobytes())
                for starts in self._line_starts(scan_chunk_bytes):
                    index.write(starts.astype(np.int64).tobytes())
                    count += len(starts)
                index.seek(len(_INDEX_MAGIC) + 16)
                index.write(np.int64(count).tobytes())
            os.replace(temporary, self.index_path)  # readers never see a half-written index
        except OSError as exc:
            temporary.unlink(missing_ok=True)
            raise InvalidRequestError(
                f"cannot write the line index {self.index_path}: {exc}", "data"
            ) from exc

    def _line_starts(self, scan_chunk_bytes: int) -> Iterator[np.ndarray]:
        if self._size == 0:
            return  # no lines at all
        yield np.zeros(1, dtype=np.int64)
        for begin in range(0, self._size, scan_chunk_bytes):
            length = min(scan_chunk_bytes, self._size - begin)
            chunk = np.frombuffer(self._data, dtype=np.uint8, count=length, offset=begin)
            newlines = np.flatnonzero(chunk == 0x0A) + begin + 1
            yield newlines[newlines < self._size]  # a final newline starts no line
        yield np.array([self._size + 1], dtype=np.int64)  # where a line after the last would start

    # ----- records ------------------------------------------------------------------------
    def __len__(self) -> int:
        return max(len(self._starts) - 1, 0)

    def raw(self, index: int) -> memoryview:
        """Line `index` (0-based) as a zero-copy view of the mapped file, without its newline."""
        if not 0 <= index < len(self):
            raise IndexError(f"line index {index} out of range for {len(self)} lines")
        start, end = int(self._starts[index]), int(self._starts[index + 1]) - 1
        view = memoryview(self._data)[start:end]
        return view[:-1] if view[-1:] == b"\r" else view

    def text(self, index: int) -> str:
        """The text field of line `index`; raises BadRecordError (with the line number) if it has
        none."""
        line_number = index + 1
        try:
            record = json.loads(bytes(self.raw(index)))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise BadRecordError(line_number, f"not valid JSON ({exc})") from exc
        if not isinstance(record, dict):
            raise BadRecordError(line_number, f"JSON {type(record).__name__}, not an object")
        value = record.get(self.text_field)
        if value is None:
            raise BadRecordError(line_number, f"no {self.text_field!r} field")
        if not isinstance(value, str):
            raise BadRecordError(
                line_number,
                f"the {self.text_field!r} field is {type(value).__name__}, not a string",
            )
        return value

    def _is_blank(self, index: int) -> bool:
        return not bytes(self.raw(index)).strip()

    def _good_text(self, index: int) -> str | None:
        if self._is_blank(index):
            return None
        try:
            return self.text(index)
        except BadRecordError as exc:
            if (
                exc.bad_line not in self.bad_lines
            ):  # report each line once, however often it is drawn
                self.bad_lines.append(exc.bad_line)
                logger.warning(
                    "%s:%d: skipped: %s", self.path, exc.bad_line.line_number, exc.bad_line.reason
                )
            return None

    def texts(self) -> Iterator[str]:
        """Every good text in file order (bad lines reported and skipped)."""
        for index in range(len(self)):
            text = self._good_text(index)
            if text is not None:
                yield text

    def shuffled_texts(self, seed: int) -> Iterator[str]:
        """Good texts in a random order fixed by `seed` (each line at most once)."""
        for index in _random_order(len(self), seed):
            text = self._good_text(index)
            if text is not None:
                yield text

    def sample(self, num_records: int, seed: int) -> list[str]:
        """`num_records` good texts drawn without replacement, the same ones for the same seed and
        file."""
        if num_records < 0:
            raise InvalidRequestError("the number of records to sample must be >= 0", "num_records")
        sampled: list[str] = []
        for text in self.shuffled_texts(seed):
            if len(sampled) == num_records:
                break
            sampled.append(text)
        return sampled

    # ----- lifetime -----------------------------------------------------------------------
    def close(self) -> None:
        self._starts = np.zeros(0, np.int64)
        if isinstance(self._data, mmap.mmap):
            self._data.close()
        self._file.close()

    def __enter__(self) -> JsonlDataset:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _random_order(count: int, seed: int) -> Iterator[int]:
    """0..count-1 in a seeded random order, without materialising a permutation up front.

    Draws with rejection while fewer than half have been seen (a sample of a huge file costs what
    the sample costs), then shuffles whatever is left.
    """
    rng = np.random.default_rng(seed)
    seen: set[int] = set()
    while len(seen) < count // 2:
        index = int(rng.integers(count))
        if index not in seen:
            seen.add(index)
            yield index
    rest = np.setdiff1d(
        np.arange(count, dtype=np.int64), np.fromiter(seen, dtype=np.int64, count=len(seen))
    )
    rng.shuffle(rest)
    for index in rest:
        yield int(index)
