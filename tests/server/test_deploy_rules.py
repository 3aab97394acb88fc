"""The shipped Prometheus rules and Grafana dashboard: promtool's own unit tests pass, and every
metric they name is one a live rebar actually exports."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from needs import need_binary

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
RULES = DEPLOY / "prometheus" / "alerts.yml"
DASHBOARD = DEPLOY / "grafana" / "rebar.json"
METRIC = re.compile(r"\brebar_[a-z0-9_]+")
RECORDED = re.compile(r"\brebar:[a-z0-9_:]+")


def promtool() -> str:
    return need_binary("promtool", "apt-get install prometheus; .ci/run installs it")


def test_promtool_checks_and_unit_tests_pass() -> None:
    tool = promtool()
    checked = subprocess.run(
        [tool, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    tested = subprocess.run(
        [tool, "test", "rules", "alerts_test.yml"],
        cwd=RULES.parent,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert tested.returncode == 0, tested.stdout + tested.stderr
    assert "SUCCESS" in tested.stdout


def dashboard_exprs() -> list[str]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [target["expr"] for panel in panels for target in panel.get("targets", [])]


def test_dashboard_only_uses_recording_rules_that_exist() -> None:
    recorded = set(re.findall(r"record:\s*(\S+)", RULES.read_text()))
    used = {name for expr in dashboard_exprs() for name in RECORDED.findall(expr)}
    assert used and used <= recorded


def test_every_metric_in_rules_and_dashboard_is_exported(server) -> None:
    url, _ = server
    # One request of each kind, so labelled series (HTTP routes, finish reasons, caches) exist.
    httpx.post(
        url + "/v1/chat/completions",
        timeout=120,
        json={"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
    )
    httpx.post(url + "/v1/embeddings", json={"model": "minilm", "input": "hi"}, timeout=60)
    text = httpx.get(url + "/metrics", timeout=30).text
    exported = {
        sample.name for family in text_string_to_metric_families(text) for sample in family.samples
    }
    referenced = set(METRIC.findall(RULES.read_text())) | {
        n for e in dashboard_exprs() for n in METRIC.findall(e)
    }
    assert len(referenced) >= 15
    assert referenced <= exported, sorted(referenced - exported)
