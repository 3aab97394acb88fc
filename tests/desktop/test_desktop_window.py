"""`rebar desktop` for real under Xvfb: pywebview over WebKitGTK, the window's own `rebar serve`
on SmolLM2. A PDF goes in through the page's file input and its summary appears (screenshot kept
under build/test-artifacts/), then it is dropped on the page; only the window's key is accepted;
closing the window, SIGTERM, or the window process being killed leaves no server process and no
open port behind."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from desktop_tools import SCREEN, xvfb
from PIL import Image
from tests.documents.files import pdf_bytes
from tests.web.web_tools import SCREENSHOT_DIR

from needs import need_binary, need_desktop_window
from rebar.documents.attribution import content_words
from rebar_bench.sample_document import CHAPTERS
from suite_tiers import limit
from waiting import HANG_S, wait_until

pytestmark = limit("browser")

DRIVER = Path(__file__).resolve().parent / "window_driver.py"
PAGES = list(CHAPTERS[1][1])  # the queen: four pages
SUMMARY_SETTINGS = """[documents]
max_chunk_tokens = 200
summary_tokens = 40
final_tokens = 60
"""
STARTED = re.compile(r"server starting on http://127\.0\.0\.1:(\d+) \(pid (\d+)\)")


@pytest.fixture(scope="module")
def display() -> Iterator[str]:
    need_desktop_window()
    with xvfb(need_binary("Xvfb", "make desktop")) as name:
        yield name


def gone(pid: int) -> bool:
    """The process has exited and been reaped (a zombie still holds its pid)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def descendants(pid: int) -> set[int]:
    """Every live process under `pid` (from /proc: its children, theirs, ...)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue  # exited while listed
        parents[int(stat.parent.name)] = int(fields[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def port_closed(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) != 0


def test_a_document_opened_in_the_window_is_summarised(display: str, tmp_path: Path) -> None:
    config = tmp_path / "rebar.toml"
    config.write_text(SUMMARY_SETTINGS)
    document = tmp_path / "queen.pdf"
    document.write_bytes(pdf_bytes(PAGES))
    SCREENSHOT_DIR.mkdir(parents=True, exist_ok=True)
    screenshot = SCREENSHOT_DIR / "desktop-window.png"
    screenshot.unlink(missing_ok=True)
    result = tmp_path / "seen.json"
    argv = [sys.executable, str(DRIVER), str(config), str(document), str(screenshot), str(result)]
    run = subprocess.run(
        argv, env={**os.environ, "DISPLAY": display}, capture_output=True, text=True, timeout=400
    )
    assert run.returncode == 0, run.stderr[-4000:]
    seen = json.loads(result.read_text())

    # the key came in the address fragment, and the page dropped it from the address
    assert seen["page_key_matches"] and "#" not in seen["address_after_load"]
    assert seen["address_after_load"] == f"http://127.0.0.1:{seen['port']}/"
    # another local caller without the window's key is refused
    assert (seen["status_without_key"], seen["status_with_wrong_key"]) == (401, 401)
    assert seen["status_with_key"] == 200 and seen["model"] == "smollm2"

    assert seen["files_in_input"] == 1
    assert seen["progress"] == "queen.pdf: done", seen["progress"]
    assert seen["statements"], "no statement appeared"
    for text, ref in seen["statements"]:
        ref = ref.strip()
        assert re.fullmatch(r"\[(pp?\. \d+(, \d+)*|no source found)\]", ref), ref
        if ref.startswith("[p"):
            for number in ref.strip("[]").split(" ", 1)[1].split(", "):
                assert content_words(text) & content_words(PAGES[int(number) - 1]), (text, ref)

    # dropped on the panel, the same document is summarised again (from the server's cache)
    assert seen["drop_taken"] and seen["dropped_progress"] == "queen.pdf: done"
    assert seen["dropped_statements"] == seen["statements"]

    # the window closed (the driver returned): its server is gone and its port closed
    assert wait_until(lambda: gone(seen["server_pid"]), HANG_S)
    assert port_closed(seen["port"])
    assert "window closed; server stopped (exit code 0)" in run.stderr

    with Image.open(screenshot) as image:
        assert image.size == SCREEN
        window = image.convert("RGB").crop((0, 0, 1000, 700))
        # a rendered page: text, fields and buttons, not a blank or single-colour screen
        assert len(window.getcolors(1 << 24) or []) > 20


def start_desktop(
    display: str, tmp_path: Path, *args: str, until: str = "model ready"
) -> tuple[subprocess.Popen[str], int, int]:
    """`rebar desktop ARGS` until it prints `until`: (process, server port, server pid)."""
    log = (tmp_path / "desktop.log").open("w+")
    process = subprocess.Popen(
        [sys.executable, "-m", "rebar.cli", "desktop", *args],
        env={**os.environ, "DISPLAY": display},
        stdout=log,
        stderr=subprocess.STDOUT,
        text=True,
    )

    def text() -> str:
        return (tmp_path / "desktop.log").read_text()

    assert wait_until(lambda: until in text() or process.poll() is not None, 120)
    started = STARTED.search(text())
    assert process.poll() is None and started, text()
    return process, int(started.group(1)), int(started.group(2))


def test_sigterm_closes_the_window_and_stops_its_server(display: str, tmp_path: Path) -> None:
    process, port, server_pid = start_desktop(display, tmp_path)
    assert not port_closed(port)
    helpers = descendants(process.pid)  # the server, WebKit's web content and network processes
    assert server_pid in helpers and len(helpers) >= 3, helpers
    process.send_signal(signal.SIGTERM)
    assert process.wait(60) == 0
    assert wait_until(lambda: all(gone(pid) for pid in helpers), HANG_S) and port_closed(port)


def test_a_killed_window_process_takes_its_server_with_it(display: str, tmp_path: Path) -> None:
    process, port, server_pid = start_desktop(display, tmp_path)
    process.kill()  # no chance to clean up: the server's parent-death signal stops it
    process.wait(30)
    assert wait_until(lambda: gone(server_pid), 60) and port_closed(port)


def test_a_server_that_cannot_start_closes_the_window_with_its_reason(
    display: str, tmp_path: Path
) -> None:
    config = tmp_path / "bad.toml"
    config.write_text("[server]\nmax_body_bytes = 1\n")  # below its bound: the server refuses it
    run = subprocess.run(
        [sys.executable, "-m", "rebar.cli", "desktop", "--config", str(config)],
        env={**os.environ, "DISPLAY": display},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2, run.stderr[-3000:]
    assert "max_body_bytes" in run.stderr  # the server's own message, above
    assert run.stderr.rstrip().endswith(
        "error: the window's server exited with code 2 before it answered (its log is above)"
    )
    assert "Traceback" not in run.stderr


def test_a_model_that_fails_to_load_is_reported_and_the_window_stays(
    display: str, tmp_path: Path
) -> None:
    process, port, server_pid = start_desktop(
        display, tmp_path, "--model", str(tmp_path / "absent.gguf"), until="failed to load"
    )
    log = (tmp_path / "desktop.log").read_text()
    assert "rebar desktop: the model failed to load: model " in log and "absent.gguf" in log
    assert process.poll() is None  # the page shows the failed model; the user closes the window
    process.send_signal(signal.SIGTERM)
    assert process.wait(60) == 0
    assert wait_until(lambda: gone(server_pid), HANG_S) and port_closed(port)


def test_a_server_that_dies_closes_its_window(display: str, tmp_path: Path) -> None:
    process, port, server_pid = start_desktop(display, tmp_path)
    os.kill(server_pid, signal.SIGKILL)
    assert process.wait(60) == 2 and port_closed(port)
    log = (tmp_path / "desktop.log").read_text()
    assert log.rstrip().endswith(
        "error: the window's server exited with code -9 while the window was open "
        "(its log is above)"
    )
