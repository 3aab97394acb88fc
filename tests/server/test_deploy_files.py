"""The production deployment files in deploy/: the systemd unit passes `systemd-analyze verify`
and stops within the drain it promises; the Locust file, run headless against a live server,
reports time to first token and inter-token latency with no failures."""

from __future__ import annotations

import configparser
import csv
import os
import subprocess
import sys
from pathlib import Path

from needs import need_binary, need_package
from rebar.config.settings import Settings

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
UNIT = DEPLOY / "systemd" / "rebar.service"
LOCUSTFILE = DEPLOY / "locust" / "locustfile.py"
INSTALLED_REBAR = "/opt/rebar/.venv/bin/rebar"


def unit_sections() -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # keys are case-sensitive
    parser.read_string(UNIT.read_text())
    return parser


def test_the_unit_passes_systemd_analyze_verify(tmp_path) -> None:
    tool = need_binary("systemd-analyze", "apt-get install systemd; .ci/run installs it")
    text = UNIT.read_text()
    assert INSTALLED_REBAR in text
    # Verified as installed, with this checkout's rebar where the unit expects its venv.
    local = tmp_path / "rebar.service"
    local.write_text(text.replace(INSTALLED_REBAR, str(Path(sys.executable).parent / "rebar")))
    verified = subprocess.run(
        [tool, "verify", str(local)], capture_output=True, text=True, timeout=60
    )
    assert verified.returncode == 0 and not (verified.stdout + verified.stderr).strip(), (
        verified.stdout + verified.stderr
    )
    broken = tmp_path / "broken.service"
    broken.write_text(text.replace(INSTALLED_REBAR, "/nonexistent/rebar"))
    refused = subprocess.run(
        [tool, "verify", str(broken)], capture_output=True, text=True, timeout=60
    )
    assert refused.returncode != 0  # the check can fail


def test_the_unit_runs_unprivileged_restarts_and_stops_after_the_drain() -> None:
    service = unit_sections()["Service"]
    assert service["User"] == service["Group"] == "rebar"
    assert service["ExecStart"].split()[1:] == ["serve", "--config", "/etc/rebar/rebar.toml"]
    assert service["EnvironmentFile"] == "-/etc/rebar/rebar.env"
    assert service["Restart"] == "on-failure" and int(service["RestartSec"]) > 0
    # SIGTERM reaches the server only; it drains, then stops its engine process itself.
    assert service["KillSignal"] == "SIGTERM" and service["KillMode"] == "mixed"
    assert int(service["TimeoutStopSec"]) > Settings().server.drain_timeout_s + 5
    assert int(service["LimitNOFILE"]) > Settings().server.max_connections
    assert service["NoNewPrivileges"] == "yes" and service["ProtectSystem"] == "strict"
    unit = unit_sections()["Unit"]
    assert int(unit["StartLimitBurst"]) > 1
    example = (DEPLOY / "systemd" / "rebar.env.example").read_text()
    assert "REBAR_SERVER__API_KEYS=" in example


def test_locust_streams_and_reports_ttft_and_inter_token_latency(server, tmp_path) -> None:
    # Only ever run in its own process: importing locust monkey-patches threads and sockets.
    need_package("locust", "pip install -e '.[test]'")
    url, _ = server
    prefix = tmp_path / "load"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "locust",
            "-f",
            str(LOCUSTFILE),
            "--host",
            url,
            "--headless",
            "-u",
            "4",
            "-r",
            "4",
            "-t",
            "10s",
            "--csv",
            str(prefix),
            "--only-summary",
            "--exit-code-on-error",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "REBAR_LOAD_MAX_TOKENS": "16"},
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    with open(f"{prefix}_stats.csv", newline="") as stats_file:
        rows = {row["Name"]: row for row in csv.DictReader(stats_file)}
    requests = rows["POST chat stream"]
    assert int(requests["Request Count"]) >= 4 and int(requests["Failure Count"]) == 0
    ttft, itl = rows["TTFT"], rows["ITL"]
    # One TTFT per stream (streams cut by the end of the run may have one and no request row).
    assert 0 <= int(ttft["Request Count"]) - int(requests["Request Count"]) <= 4
    assert int(itl["Request Count"]) > int(ttft["Request Count"])  # several gaps per stream
    assert 0 < float(itl["Median Response Time"]) < float(ttft["Max Response Time"]) * 10
