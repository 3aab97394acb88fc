"""The mmap JSONL reader: index built once and saved, zero-copy records, bad lines, deterministic
sampling, streaming."""

from __future__ import annotations

import json
import logging
import mmap
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rebar.errors import InvalidRequestError
from rebar.quant.calib_data import BadLine, JsonlDataset

SRC = Path(__file__).resolve().parents[2] / "src"


def write_lines(
    path: Path, lines: list[str], newline: str = "\n", final_newline: bool = True
) -> Path:
    path.write_bytes((newline.join(lines) + (newline if final_newline else "")).encode())
    return path


def records(count: int) -> list[str]:
    return [json.dumps({"text": f"record {i} é", "id": i}) for i in range(count)]


def test_lines_and_texts(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "d.jsonl", records(5))
    with JsonlDataset(path) as dataset:
        assert len(dataset) == 5
        assert dataset.text(3) == "record 3 é"
        assert list(dataset.texts()) == [f"record {i} é" for i in range(5)]
        assert not dataset.bad_lines


def test_records_are_zero_copy_views_of_the_mapping(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "d.jsonl", records(3))
    with JsonlDataset(path) as dataset:
        view = dataset.raw(1)
        assert isinstance(view, memoryview) and isinstance(view.obj, mmap.mmap)
        assert bytes(view) == records(3)[1].encode()
        del view
        with pytest.raises(IndexError):
            dataset.raw(3)


def test_index_is_saved_beside_the_file_and_reused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_lines(tmp_path / "d.jsonl", records(4))
    with JsonlDataset(path):
        pass
    index = tmp_path / "d.jsonl.idx"
    assert index.is_file()

    def fail(*args: object) -> None:
        raise AssertionError("the index was rebuilt")

    monkeypatch.setattr(JsonlDataset, "_write_index", fail)
    with JsonlDataset(path) as dataset:
        assert dataset.text(3) == "record 3 é"


def test_index_is_rebuilt_when_the_file_changes(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "d.jsonl", records(4))
    with JsonlDataset(path) as dataset:
        assert len(dataset) == 4
    write_lines(path, records(7))
    with JsonlDataset(path) as dataset:
        assert len(dataset) == 7 and dataset.text(6) == "record 6 é"
    # a truncated index is not trusted either
    index = tmp_path / "d.jsonl.idx"
    index.write_bytes(index.read_bytes()[:-8])
    with JsonlDataset(path) as dataset:
        assert dataset.text(6) == "record 6 é"


@pytest.mark.parametrize("chunk", [1, 7, 64, 1 << 20])
@pytest.mark.parametrize(
    ("newline", "final"),
    [("\n", True), ("\n", False), ("\r\n", True)],
    ids=["lf", "no-final", "crlf"],
)
def test_index_is_the_same_for_any_scan_chunk(
    tmp_path: Path, chunk: int, newline: str, final: bool
) -> None:
    path = write_lines(tmp_path / "d.jsonl", records(9), newline, final)
    with JsonlDataset(path, scan_chunk_bytes=chunk) as dataset:
        assert [dataset.text(i) for i in range(len(dataset))] == [f"record {i} é" for i in range(9)]


def test_empty_file(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "d.jsonl", [], final_newline=False)
    with JsonlDataset(path) as dataset:
        assert len(dataset) == 0 and dataset.sample(3, seed=0) == []


def test_bad_lines_are_reported_with_their_number_and_skipped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    lines = [
        '{"text": "a"}',
        "",
        '{"text": 3}',
        "not json",
        '{"text": "b"}',
        "[1]",
        '{"t": "x"}',
        '{"text": "c"}',
        "\xff",
    ]
    path = tmp_path / "d.jsonl"
    path.write_bytes("\n".join(lines[:-1]).encode() + b"\n\xff\xfe\n")
    with caplog.at_level(logging.WARNING, logger="rebar.quant"), JsonlDataset(path) as dataset:
        assert list(dataset.texts()) == ["a", "b", "c"]
        assert [bad.line_number for bad in dataset.bad_lines] == [3, 4, 6, 7, 9]
        assert dataset.bad_lines[0] == BadLine(3, "the 'text' field is int, not a string")
        assert dataset.bad_lines[3] == BadLine(7, "no 'text' field")
        list(dataset.texts())  # a second pass reports nothing new
        assert len(dataset.bad_lines) == 5
    assert f"{path}:4: skipped: not valid JSON" in caplog.text
    assert caplog.text.count(":4: skipped") == 1


def test_text_field_is_configurable(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "d.jsonl", [json.dumps({"body": "x", "text": "y"})])
    with JsonlDataset(path, text_field="body") as dataset:
        assert dataset.text(0) == "x"


def test_sampling_is_deterministic_and_without_replacement(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "d.jsonl", records(200) + ["bad line"] * 50)
    with JsonlDataset(path) as dataset:
        first = dataset.sample(20, seed=1)
        assert len(first) == 20 and len(set(first)) == 20
        assert dataset.sample(20, seed=1) == first
        assert dataset.sample(20, seed=2) != first
        everything = dataset.sample(1000, seed=3)  # more than there are: every good text, once
        assert sorted(everything) == sorted(f"record {i} é" for i in range(200))
    with JsonlDataset(path) as reopened:
        assert reopened.sample(20, seed=1) == first
    with pytest.raises(InvalidRequestError):
        reopened.sample(-1, seed=0)


def test_missing_file_and_unwritable_index(tmp_path: Path) -> None:
    with pytest.raises(InvalidRequestError, match="does not exist"):
        JsonlDataset(tmp_path / "absent.jsonl")
    path = write_lines(tmp_path / "d.jsonl", records(2))
    (tmp_path / "d.jsonl.idx").mkdir()  # something that is not an index file sits where it goes
    with pytest.raises(InvalidRequestError, match="cannot write the line index"):
        JsonlDataset(path)


def test_streams_a_file_larger_than_the_memory_it_may_allocate(tmp_path: Path) -> None:
    """With the data segment capped below the file size, reading the file fails but indexing and
    sampling work."""
    path = tmp_path / "big.jsonl"
    line = (json.dumps({"text": "x" * 900}) + "\n").encode()
    with open(path, "wb") as out:
        for _ in range(160):
            out.write(line * 1000)  # 146 MB in all
    limit = 100 * 2**20
    script = textwrap.dedent(f"""
        import resource
        resource.setrlimit(resource.RLIMIT_DATA, ({limit}, {limit}))
        from rebar.quant.calib_data import JsonlDataset
        with JsonlDataset({str(path)!r}) as dataset:
            assert len(dataset) == 160_000 and len(dataset.sample(5, seed=0)) == 5
        try:
            open({str(path)!r}, "rb").read()
        except MemoryError:
            print("streamed")
    """)
    env = {
        **os.environ,
        "PYTHONPATH": str(SRC),
        "OPENBLAS_NUM_THREADS": "1",
        "OMP_NUM_THREADS": "1",
    }
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "streamed"
