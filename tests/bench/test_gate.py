"""The performance gate's judgement: normalised figures against a baseline, a failing figure named with its excess."""

from __future__ import annotations

import json

import pytest
import torch

from rebar.bench import gate
from rebar.bench.gate import GateFigures, calibrate, judge


def test_judge_passes_within_tolerance_and_names_what_failed() -> None:
    baseline = {"cold_start": 10.0, "p95_latency": 2.0, "peak_rss": 500.0}
    verdicts = {
        v.figure: v
        for v in judge({"cold_start": 13.0, "p95_latency": 2.8, "peak_rss": 580.0}, baseline)
    }
    assert verdicts["cold_start"].passed  # +30% <= +35%
    assert not verdicts["p95_latency"].passed  # +40%
    assert not verdicts["peak_rss"].passed  # +16% > +15%
    assert (
        verdicts["p95_latency"].line().startswith("FAIL p95_latency")
        and "+40.0%" in verdicts["p95_latency"].line()
    )
    assert verdicts["cold_start"].line().startswith("ok")
    with pytest.raises(ValueError, match="baseline lacks peak_rss"):
        judge(
            {"cold_start": 1, "p95_latency": 1, "peak_rss": 1}, {"cold_start": 1, "p95_latency": 1}
        )


def test_calibration_is_a_positive_repeatable_duration() -> None:
    first, second = calibrate(repeats=3, steps=4), calibrate(repeats=3, steps=4)
    assert first > 0 and second > 0
    assert 0.2 < first / second < 5


def test_run_gate_writes_a_baseline_then_fails_on_a_regression(
    tmp_path, monkeypatch, capsys
) -> None:
    figures = GateFigures(0.1, 3.0, 0.5, 30.0, 5.0, 400.0)
    monkeypatch.setattr(gate, "measure", lambda model: figures)
    path = tmp_path / "perf" / "baseline.json"
    assert gate.run_gate("smollm2", path, update=True) == 0
    assert json.loads(path.read_text())["figures"] == {
        "cold_start": 30.0,
        "p95_latency": 5.0,
        "peak_rss": 400.0,
    }
    assert gate.run_gate("smollm2", path) == 0
    assert "performance gate passed" in capsys.readouterr().out

    monkeypatch.setattr(gate, "measure", lambda model: GateFigures(0.1, 3.0, 0.8, 30.0, 8.0, 400.0))
    assert gate.run_gate("smollm2", path) == 1
    out = capsys.readouterr().out
    assert "performance gate FAILED: p95_latency is 60.0% above its baseline (limit 35%)" in out
    with pytest.raises(ValueError, match="measured on 'smollm2'"):
        gate.run_gate("other-model", path)
    with pytest.raises(ValueError, match="measured with 1 thread"):
        gate.run_gate("smollm2", path, threads=2)


def test_the_gate_runs_at_its_thread_count_and_restores_the_callers(tmp_path, monkeypatch) -> None:
    seen = []
    monkeypatch.setattr(
        gate,
        "measure",
        lambda model: (
            seen.append(torch.get_num_threads()) or GateFigures(0.1, 3.0, 0.5, 30.0, 5.0, 400.0)
        ),
    )
    before = torch.get_num_threads()
    gate.run_gate("smollm2", tmp_path / "b.json", update=True, threads=1)
    assert seen == [1] and torch.get_num_threads() == before
    assert json.loads((tmp_path / "b.json").read_text())["threads"] == 1


def test_missing_baseline_is_a_clear_refusal(tmp_path, capsys) -> None:
    assert gate.run_gate("smollm2", tmp_path / "none.json") == 2
    assert "no baseline at" in capsys.readouterr().out
