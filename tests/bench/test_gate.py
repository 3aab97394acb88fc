"""The performance gate: a real measurement of a tiny quantized GGUF through the default path, the
baseline it records (machine, commit, workload), and the judgement and re-baselining rules applied
to that measurement."""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf_builder import TinyConfig, model_contents, random_hf_state

from needs import need_cpu_kernels
from rebar_bench import gate
from rebar_bench.gate import Measurement, Workload, calibrate
from rebar_bench.gate_baseline import FORMAT, TOLERANCES, Baseline, BaselineError, judge

REPO = Path(__file__).resolve().parents[2]
TINY = Workload(
    prompt_tokens=16, decode_tokens=4, streams=4, repeats=1, calibration_steps=2, baseline_runs=1
)
# The baseline this repository committed before the gate measured the default path.
OLD_FORMAT = {
    "model": "smollm2",
    "threads": 1,
    "figures": {"cold_start": 23.1, "p95_latency": 2.66, "peak_private": 97.2},
}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    need_cpu_kernels()  # the default path keeps the weights quantized on rebar's kernels
    # KV-heavy for its size: the default KV budget (2 GiB on the CPU) in few blocks, a quick load
    config = TinyConfig(hidden=256, heads=4, kv_heads=4, layers=4, intermediate=512, context=512)
    contents = model_contents(config, random_hf_state(config, seed=2), QT.Q8_0)
    return str(contents.write(tmp_path_factory.mktemp("gate") / "tiny-Q8_0.gguf"))


@pytest.fixture(scope="module")
def recorded(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A baseline recorded by the real gate: calibration, two fresh processes, the engine runs."""
    path = tmp_path_factory.mktemp("perf") / "baseline.json"
    before = torch.get_num_threads()
    assert gate.run_gate(tiny_model, path, update=True, threads=1, workload=TINY) == 0
    assert torch.get_num_threads() == before
    return path


@pytest.fixture
def measured(recorded: Path) -> Measurement:
    return Measurement(**json.loads(recorded.read_text())["raw"])


def test_the_gate_measures_the_default_quantized_path(
    recorded: Path, measured: Measurement
) -> None:
    record = json.loads(recorded.read_text())
    assert measured.fused_decode, "decode steps must run on the fused CPU step"
    assert set(record["figures"]) == set(TOLERANCES)
    assert all(value > 0 for value in record["figures"].values())
    assert measured.seconds["cold_start"] > measured.seconds["decode"]
    assert record["figures"]["decode"] == pytest.approx(
        measured.seconds["decode"] / measured.calibration_s
    )


def test_a_baseline_records_what_and_where_it_measured(recorded: Path, tiny_model: str) -> None:
    record = json.loads(recorded.read_text())
    assert record["format"] == FORMAT and record["model"] == tiny_model
    assert record["threads"] == 1 and record["workload"] == asdict(TINY)
    assert record["machine"]["cores"] >= 1 and record["machine"]["cpu"]
    assert len(record["commit"]["sha"]) == 40  # tests run from a git checkout
    assert record["recorded_at"] and record["accepted_regression"] is None


def test_judge_passes_within_tolerance_and_names_what_failed() -> None:
    baseline = dict.fromkeys(TOLERANCES, 10.0) | {"peak_private": 500.0}
    measured = baseline | {"cold_start": 13.0, "p95_latency": 18.0, "peak_private": 580.0}
    verdicts = {v.figure: v for v in judge(measured, baseline)}
    assert verdicts["cold_start"].passed  # +30% <= +35%
    assert not verdicts["p95_latency"].passed  # +80% > +75%
    assert not verdicts["peak_private"].passed  # +16% > +15%
    line = verdicts["p95_latency"].line()
    assert line.startswith("FAIL p95_latency") and "+80.0%" in line
    assert verdicts["cold_start"].line().startswith("ok")
    with pytest.raises(BaselineError, match="baseline lacks peak_private"):
        judge(measured, {name: 1.0 for name in TOLERANCES if name != "peak_private"})


def slower(measurement: Measurement, figure: str, factor: float) -> Measurement:
    return replace(
        measurement, seconds=measurement.seconds | {figure: measurement.seconds[figure] * factor}
    )


@pytest.fixture
def copy_of(recorded: Path, tmp_path: Path) -> Path:
    path = tmp_path / "baseline.json"
    path.write_text(recorded.read_text())
    return path


def gate_with(monkeypatch, measurement: Measurement) -> None:
    monkeypatch.setattr(gate, "measure", lambda model, workload, threads: measurement)


def test_the_same_figures_pass_and_a_regression_fails(
    tiny_model, copy_of, measured, monkeypatch, capsys
) -> None:
    gate_with(monkeypatch, measured)
    assert gate.run_gate(tiny_model, copy_of, threads=1, workload=TINY) == 0
    out = capsys.readouterr().out
    assert "performance gate passed" in out and "baseline: commit" in out
    gate_with(monkeypatch, slower(measured, "batched_decode", 1.6))
    assert gate.run_gate(tiny_model, copy_of, threads=1, workload=TINY) == 1
    out = capsys.readouterr().out
    assert "performance gate FAILED: batched_decode is 60.0% above its baseline (limit 50%)" in out


def test_rebaselining_refuses_a_regression_without_a_stated_reason(
    tiny_model, copy_of, measured, monkeypatch, capsys
) -> None:
    before = copy_of.read_text()
    gate_with(monkeypatch, slower(measured, "decode", 2.0))
    assert gate.run_gate(tiny_model, copy_of, update=True, threads=1, workload=TINY) == 1
    assert "refusing to re-baseline" in capsys.readouterr().out and copy_of.read_text() == before

    reason = "the fused step now checks its inputs"
    code = gate.run_gate(
        tiny_model, copy_of, update=True, threads=1, workload=TINY, accept_regression=reason
    )
    assert code == 0
    record = json.loads(copy_of.read_text())
    assert record["accepted_regression"] == {"reason": reason, "figures": {"decode": "+100.0%"}}
    assert gate.run_gate(tiny_model, copy_of, threads=1, workload=TINY) == 0  # the new normal


def test_accepting_a_regression_needs_an_update_and_a_reason(tiny_model, copy_of) -> None:
    assert gate.run_gate(tiny_model, copy_of, accept_regression="why") == 2
    assert gate.run_gate(tiny_model, copy_of, update=True, accept_regression=" ") == 2


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"threads": 2}, "measured with threads 1, not 2"),
        ({"model": "smollm2"}, "measured with model"),
        ({"workload": replace(TINY, streams=8)}, "measured with workload"),
    ],
    ids=["threads", "model", "workload"],
)
def test_a_baseline_judges_only_the_same_model_threads_and_workload(
    tiny_model, copy_of, change, message, capsys
) -> None:
    arguments = {"model": tiny_model, "threads": 1, "workload": TINY} | change
    assert gate.run_gate(baseline_path=copy_of, **arguments) == 2
    out = capsys.readouterr().out
    assert message in out and "--update-baseline" in out


def test_an_old_format_baseline_is_refused_with_how_to_re_record(
    tiny_model, tmp_path, measured, monkeypatch, capsys
) -> None:
    path = tmp_path / "baseline.json"
    path.write_text(json.dumps(OLD_FORMAT))
    assert gate.run_gate(tiny_model, path, threads=1, workload=TINY) == 2
    out = capsys.readouterr().out
    assert "older format" in out and f"rebar bench gate --update-baseline --baseline {path}" in out
    gate_with(monkeypatch, measured)
    assert gate.run_gate(tiny_model, path, update=True, threads=1, workload=TINY) == 0
    assert json.loads(path.read_text())["format"] == FORMAT


def test_missing_baseline_is_a_clear_refusal(tmp_path, capsys) -> None:
    assert gate.run_gate("smollm2", tmp_path / "none.json") == 2
    assert "no baseline at" in capsys.readouterr().out


def test_the_committed_baseline_is_in_the_current_format_for_the_default_workload() -> None:
    baseline = Baseline.read(REPO / "perf" / "baseline.json")
    assert baseline.data["model"] == "smollm2"
    assert baseline.data["workload"] == asdict(Workload())
    if baseline.figures is None:  # a placeholder until it is recorded on a quiet machine
        assert "holds no measurement yet" in (
            baseline.mismatch("smollm2", 2, asdict(Workload())) or ""
        )
    else:
        assert set(baseline.figures) == set(TOLERANCES)


def test_calibration_is_a_positive_repeatable_duration() -> None:
    first, second = calibrate(repeats=3, steps=4), calibrate(repeats=3, steps=4)
    assert first > 0 and second > 0
    assert 0.2 < first / second < 5


def test_help_states_the_re_baselining_procedure(capsys) -> None:
    from rebar.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "gate", "--help"])
    assert exit_info.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "--accept-regression REASON" in out and "refuses to write a regression" in out
    assert "quiet machine" in out and "records the machine, the commit" in out


def test_peak_private_memory_leaves_out_pages_mapped_from_files() -> None:
    # The same process maps more or fewer library pages depending on the page cache; only its
    # private pages are gated.
    status = "Name:\tpython\nVmHWM:\t  400000 kB\nVmRSS:\t  390000 kB\nRssAnon:\t  280000 kB\n"
    status += "RssFile:\t  110000 kB\nRssShmem:\t       0 kB\n"
    assert gate.peak_private_kib(status) == 290000
    own_peak_kib = int(Path("/proc/self/status").read_text().split("VmHWM:")[1].split()[0])
    assert 0 < gate.peak_private_kib() < own_peak_kib


def test_a_re_recorded_baseline_holds_the_median_of_its_runs() -> None:
    def run(calibration: float, prefill_s: float, memory: float) -> Measurement:
        return Measurement(calibration, {"prefill": prefill_s, "decode": 0.01}, memory, True)

    # prefill / calibration per run: 2.0, 1.0 (a lucky run), 3.0
    median = Measurement.median([run(0.1, 0.2, 100), run(0.2, 0.2, 120), run(0.1, 0.3, 110)])
    figures = median.figures()
    assert figures["prefill"] == pytest.approx(2.0) and median.peak_private_mib == 110
    assert figures["decode"] == pytest.approx(0.1) and median.calibration_s == 0.1
    assert not Measurement.median(
        [run(0.1, 0.2, 1), replace(run(0.1, 0.2, 1), fused_decode=False)]
    ).fused_decode
