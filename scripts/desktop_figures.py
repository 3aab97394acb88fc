"""Cold start and memory of `rebar desktop`: several fresh windows, medians.

Each run starts `rebar desktop` (default model), times from the command's start to the lines it
prints (window shown, server answering, chat page loaded) and to the server reporting ready
(/ready: the model loaded and warmed up), then, a few seconds after that, reads the memory of the
window process, of WebKit's processes under it (web content, network), and of the server beside
it: RSS, and PSS (shared pages split between the processes that map them, so the column adds up).
Then SIGTERM closes the window, and the run checks that the server is gone.

    flock -x /tmp/rebar-cpu.lock xvfb-run -a -s "-screen 0 1280x900x24" \\
        .venv/bin/python scripts/desktop_figures.py --runs 5
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil

LINE = re.compile(r"rebar desktop: (window shown|server answering|chat page loaded) after")
STARTED = re.compile(r"server starting on (http://127\.0\.0\.1:\d+) \(pid (\d+)\)")
SETTLE_S = 3.0
TIMEOUT_S = 180.0
MIB = 2**20


def ready(base_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base_url}/ready", timeout=2) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def memory(processes: list[psutil.Process]) -> tuple[float, float]:
    """(RSS, PSS) of `processes` together, in MiB."""
    rss = pss = 0
    for process in processes:
        info = process.memory_full_info()
        rss += info.rss
        pss += info.pss
    return rss / MIB, pss / MIB


def one_run(argv: list[str]) -> dict[str, float]:
    started = time.monotonic()
    process = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True)
    seen: dict[str, float] = {}
    server: list[str] = []

    def read() -> None:
        assert process.stderr is not None
        for line in process.stderr:
            if match := STARTED.search(line):
                server[:] = match.groups()
            if match := LINE.search(line):
                seen.setdefault(f"{match.group(1)} s", time.monotonic() - started)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        deadline = started + TIMEOUT_S
        while not (server and "chat page loaded s" in seen and ready(server[0])):
            if time.monotonic() > deadline or process.poll() is not None:
                raise SystemExit(f"rebar desktop did not get ready (exit {process.poll()})")
            time.sleep(0.05)
        seen["model ready s"] = time.monotonic() - started
        time.sleep(SETTLE_S)
        window = psutil.Process(process.pid)
        server_process = psutil.Process(int(server[1]))
        server_tree = [server_process, *server_process.children(recursive=True)]
        webkit = [p for p in window.children(recursive=True) if p not in server_tree]
        for name, group in (("window", [window]), ("webkit", webkit), ("server", server_tree)):
            seen[f"{name} rss MiB"], seen[f"{name} pss MiB"] = memory(group)
    finally:
        process.send_signal(signal.SIGTERM)
        code = process.wait(60)
    if code != 0 or psutil.pid_exists(int(server[1])):
        raise SystemExit(f"the window exited {code}, or left its server running")
    return seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None, help="write every run and the medians")
    parser.add_argument("desktop_args", nargs="*", help="passed to `rebar desktop`")
    args = parser.parse_args()
    argv = [sys.executable, "-m", "rebar.cli", "desktop", *args.desktop_args]
    runs = []
    for index in range(args.runs):
        runs.append(one_run(argv))
        print(f"run {index + 1}: " + ", ".join(f"{k} {v:.2f}" for k, v in runs[-1].items()))
    medians = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
    print("median: " + ", ".join(f"{k} {v:.2f}" for k, v in medians.items()))
    if args.json is not None:
        args.json.write_text(json.dumps({"argv": argv, "runs": runs, "median": medians}, indent=1))


if __name__ == "__main__":
    main()
