"""`rebar summarize` as a user runs it, on the bundled SmolLM2: the summary on stdout with its
pages, progress on stderr, the cache on a second run, a bad file refused before the model loads,
and Ctrl-C cancelling cleanly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from tests.documents.files import pdf_bytes
from tests.suite_tiers import limit

from rebar.documents.attribution import content_words
from rebar_bench.sample_document import CHAPTERS
from waiting import HANG_S

pytestmark = limit("processes")
REBAR = [sys.executable, "-m", "rebar.cli", "summarize"]
SMALL = ["--max-model-len", "2048", "--kv-cache-memory", str(128 * 2**20)]


def env(tmp_path, **settings: str) -> dict[str, str]:
    values = {"REBAR_DOCUMENTS__CACHE_DIR": str(tmp_path / "cache"), **settings}
    return {**os.environ, **values}


def test_summary_with_pages_then_from_the_cache(tmp_path) -> None:
    pages = list(CHAPTERS[4][1])  # honey: four pages
    path = tmp_path / "honey.pdf"
    path.write_bytes(pdf_bytes(pages))
    settings = {
        "REBAR_DOCUMENTS__MAX_CHUNK_TOKENS": "128",
        "REBAR_DOCUMENTS__SUMMARY_TOKENS": "40",
        "REBAR_DOCUMENTS__FINAL_TOKENS": "80",
    }
    command = [*REBAR, str(path), "--style", "key_points", *SMALL]
    first = subprocess.run(
        command, capture_output=True, text=True, env=env(tmp_path, **settings), timeout=600
    )
    assert first.returncode == 0, first.stderr
    lines = first.stdout.strip().splitlines()
    assert lines and all(line.startswith("- ") for line in lines)
    cited = 0
    for line in lines:
        text, _, ref = line[2:].rpartition(" [")
        if ref.startswith("p"):
            cited += 1
            for page in ref.rstrip("]").split(" ", 1)[1].split(", "):
                assert content_words(text) & content_words(pages[int(page) - 1]), line
    assert cited >= 1
    assert "honey" in first.stdout.lower()
    assert "] chunk " in first.stderr and "] final 1/1" in first.stderr
    again = subprocess.run(
        command, capture_output=True, text=True, env=env(tmp_path, **settings), timeout=600
    )
    assert again.returncode == 0 and again.stdout == first.stdout
    assert "from the cache" in again.stderr and "] chunk " not in again.stderr


def test_a_bad_file_is_refused_before_the_model_loads(tmp_path) -> None:
    path = tmp_path / "locked.pdf"
    path.write_bytes(pdf_bytes(["secret"], user_password="pw"))
    result = subprocess.run(
        [*REBAR, str(path)], capture_output=True, text=True, env=env(tmp_path), timeout=120
    )
    assert result.returncode == 2
    assert (
        result.stderr.strip().splitlines()[-1] == "error: locked.pdf: the PDF is password-protected"
    )
    missing = subprocess.run(
        [*REBAR, str(tmp_path / "nope.pdf")],
        capture_output=True,
        text=True,
        env=env(tmp_path),
        timeout=120,
    )
    assert missing.returncode == 2 and "nope.pdf" in missing.stderr


def test_ctrl_c_cancels_cleanly(tmp_path) -> None:
    path = tmp_path / "long.pdf"
    path.write_bytes(pdf_bytes([page for _, pages in CHAPTERS for page in pages]))
    # Every chapter: many chunks, so the signal lands after the first is summarised and long
    # before the final summary writes anything to stdout.
    settings = {"REBAR_DOCUMENTS__MAX_CHUNK_TOKENS": "200", "REBAR_DOCUMENTS__SUMMARY_TOKENS": "64"}
    process = subprocess.Popen(
        [*REBAR, str(path), *SMALL],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env(tmp_path, **settings),
        # Ctrl-C as a terminal's foreground command gets it: a suite started in the background
        # (`make test &`) passes SIGINT down ignored, and Python then leaves it ignored.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    assert process.stderr is not None
    planned = False
    for line in process.stderr:
        planned = planned or "chunk(s)" in line  # the plan, once the model has loaded
        if planned and "] chunk " in line:  # a chunk's summary is done: requests are in flight
            break
    process.send_signal(signal.SIGINT)
    stdout, stderr = process.communicate(timeout=HANG_S)
    assert process.returncode == 130, stderr
    assert "cancelled: every request of the summary was aborted" in stderr
    assert "Traceback" not in stderr
    assert stdout == ""
    assert not list((tmp_path / "cache").glob("*.json")), "an unfinished summary is not cached"
