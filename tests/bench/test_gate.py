"""The performance gate: a real measurement of a tiny quantized GGUF through the default path, the
baseline it records (machine, commit, workload), and the judgement and re-baselining rules applied
to that measurement."""

from __future__ import annotations

import json
import statistics
import subprocess
import time
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf_builder import TinyConfig, model_contents, random_hf_state

from needs import need_binary, need_cpu_kernels
from rebar_bench import gate, gate_measure
from rebar_bench.gate import Measurement, Workload, calibrate
from rebar_bench.gate_baseline import (
    FORMAT,
    GREEDY_CHANGE,
    TOLERANCES,
    Baseline,
    BaselineError,
    judge,
)
from rebar_bench.gate_measure import DecodePath, engine_figures

REPO = Path(__file__).resolve().parents[2]
TINY = Workload(
    prompt_tokens=16,
    decode_tokens=4,
    depth_tokens=200,
    depth_decode_tokens=4,
    streams=4,
    repeats=1,
    calibration_steps=2,
    serving_requests=2,
    greedy_tokens=8,
    baseline_runs=1,
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
    return Measurement.from_json(json.loads(recorded.read_text())["raw"])


@pytest.fixture(scope="module")
def tiny_llm(tiny_model: str):
    return gate_measure.default_llm(tiny_model)


def test_the_gate_measures_the_default_quantized_path(
    recorded: Path, measured: Measurement, tiny_model: str
) -> None:
    from rebar.kernels import cpu_quant

    record = json.loads(recorded.read_text())
    assert set(record["figures"]) == set(TOLERANCES)
    assert all(value > 0 for value in record["figures"].values())
    # Every single-stream decode row (decode and decode at depth, the first token of each aside)
    # went through the fused step, on the kernels built for this CPU.
    rows = TINY.repeats * (TINY.decode_tokens - 1 + TINY.depth_decode_tokens - 1)
    assert measured.path == DecodePath(cpu_quant.isa(), rows, rows) and measured.path.fused
    # The greedy tokens are the model's own continuation, as a separately loaded LLM gives it.
    from rebar.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=TINY.greedy_tokens, temperature=0, ignore_eos=True)
    (reference,) = gate_measure.default_llm(tiny_model).generate(gate_measure.GREEDY_PROMPT, params)
    assert measured.greedy_tokens == reference.token_ids and len(reference.token_ids) == 8


def test_a_slower_decode_step_moves_the_decode_figures_and_fails_the_gate(
    tiny_llm, recorded: Path, measured: Measurement
) -> None:
    """A regression injected into the fused decode step (a sleep per call) shows in the decode
    figures measured by the gate's own code, and the gate names them."""
    runner = tiny_llm.engine.runner
    fused = runner.fused_decoder
    delay_s = 0.02

    def slow_step(*args):
        time.sleep(delay_s)
        return fused(*args)

    slow_step.max_rows = fused.max_rows  # type: ignore[attr-defined]
    runner.fused_decoder = slow_step
    try:
        figures, path = engine_figures(tiny_llm, TINY)
    finally:
        runner.fused_decoder = fused
    # A lower bound on a sleep cannot flake: a slow machine only adds to it.
    assert statistics.median(figures["decode"].seconds) >= delay_s
    assert statistics.median(figures["decode_at_depth"].seconds) >= delay_s
    assert path.fused
    slowed = {name: statistics.median(runs.ratios) for name, runs in figures.items()}
    verdicts = {v.figure: v for v in judge(measured.figures() | slowed, measured.figures())}
    assert not verdicts["decode"].passed and not verdicts["decode_at_depth"].passed


def test_decoding_off_the_fused_step_fails_the_gate_however_fast(
    tiny_model, copy_of, tiny_llm, measured, monkeypatch, capsys
) -> None:
    runner = tiny_llm.engine.runner
    fused = runner.fused_decoder
    runner.fused_decoder = None
    try:
        _figures, path = engine_figures(tiny_llm, TINY)
    finally:
        runner.fused_decoder = fused
    assert path.fused_rows == 0 and path.decode_rows > 0 and not path.fused
    gate_with(monkeypatch, replace(measured, path=path))
    assert gate.run_gate(tiny_model, copy_of, threads=1, workload=TINY) == 1
    assert "decode left the fused step (0 of" in capsys.readouterr().out
    # ... and such a run is never recorded, whatever reason is given.
    code = gate.run_gate(
        tiny_model, copy_of, update=True, threads=1, workload=TINY, accept_regression="faster"
    )
    assert (
        code == 1
        and "refusing to re-baseline: decode left the fused step" in capsys.readouterr().out
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"kernels": "avx2-elsewhere"}, "the kernels ran avx2-elsewhere, the baseline's"),
        ({"kernels": "unavailable"}, "rebar's compiled CPU kernels were unavailable"),
    ],
)
def test_other_kernels_fail_the_gate(
    tiny_model, copy_of, measured, monkeypatch, capsys, change, message
) -> None:
    gate_with(monkeypatch, replace(measured, path=replace(measured.path, **change)))
    assert gate.run_gate(tiny_model, copy_of, threads=1, workload=TINY) == 1
    assert message in capsys.readouterr().out


def test_other_greedy_tokens_fail_the_gate_and_are_recorded_only_with_a_reason(
    tiny_model, copy_of, measured, monkeypatch, capsys
) -> None:
    tokens = list(measured.greedy_tokens)
    tokens[3] += 1
    gate_with(monkeypatch, replace(measured, greedy_tokens=tokens))
    assert gate.run_gate(tiny_model, copy_of, threads=1, workload=TINY) == 1
    out = capsys.readouterr().out
    assert f"{GREEDY_CHANGE} at token 3: [{tokens[3]}" in out
    assert gate.run_gate(tiny_model, copy_of, update=True, threads=1, workload=TINY) == 1
    reason = "the sampler now breaks ties by the lowest id"
    code = gate.run_gate(
        tiny_model, copy_of, update=True, threads=1, workload=TINY, accept_regression=reason
    )
    assert code == 0
    record = json.loads(copy_of.read_text())
    assert record["accepted_regression"]["figures"] == {"greedy_tokens": "changed"}
    assert record["raw"]["greedy_tokens"] == tokens


def test_a_baseline_records_what_and_where_it_measured(recorded: Path, tiny_model: str) -> None:
    record = json.loads(recorded.read_text())
    assert record["format"] == FORMAT and record["model"] == tiny_model
    assert record["threads"] == 1 and record["workload"] == asdict(TINY)
    assert record["machine"]["cores"] >= 1 and record["machine"]["cpu"]
    assert len(record["commit"]["sha"]) == 40  # tests run from a git checkout
    assert record["recorded_at"] and record["accepted_regression"] is None


def test_judge_passes_within_tolerance_and_names_what_failed() -> None:
    baseline = dict.fromkeys(TOLERANCES, 10.0) | {"peak_private": 500.0}
    measured = baseline | {"cold_start": 12.9, "decode": 12.6, "peak_private": 580.0}
    verdicts = {v.figure: v for v in judge(measured, baseline)}
    assert verdicts["cold_start"].passed  # +29% <= +30%
    assert not verdicts["decode"].passed  # +26% > +25%
    assert not verdicts["peak_private"].passed  # +16% > +15%
    line = verdicts["decode"].line()
    assert line.startswith("FAIL decode") and "+26.0%" in line
    assert verdicts["cold_start"].line().startswith("ok")
    with pytest.raises(BaselineError, match="baseline lacks peak_private"):
        judge(measured, {name: 1.0 for name in TOLERANCES if name != "peak_private"})


def slower(measurement: Measurement, figure: str, factor: float) -> Measurement:
    normalised = measurement.normalised | {figure: measurement.normalised[figure] * factor}
    return replace(measurement, normalised=normalised)


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
    gate_with(monkeypatch, slower(measured, "decode", 1.3))
    assert gate.run_gate(tiny_model, copy_of, threads=1, workload=TINY) == 1
    out = capsys.readouterr().out
    assert "performance gate FAILED: decode is 30.0% above its baseline (limit 25%)" in out


def judged_over_three_runs(copy_of: Path) -> Workload:
    """The tiny workload with three runs to a baseline, and the copied baseline recorded for it."""
    record = json.loads(copy_of.read_text())
    record["workload"]["baseline_runs"] = 3
    copy_of.write_text(json.dumps(record))
    return replace(TINY, baseline_runs=3)


def gate_measuring(monkeypatch, runs: list[Measurement]) -> list[Measurement]:
    """`measure` hands out `runs` in order; returns the list of those it handed out."""
    handed: list[Measurement] = []

    def measure(model, workload, threads) -> Measurement:
        handed.append(runs[len(handed)])
        return handed[-1]

    monkeypatch.setattr(gate, "measure", measure)
    return handed


@pytest.mark.parametrize(
    ("slow_runs", "code", "verdict"),
    [
        ((0,), 0, "performance gate passed"),
        ((0, 2), 1, "performance gate FAILED: decode is 30.0% above its baseline (limit 25%)"),
    ],
    ids=["one-slow-run-passes", "slow-in-most-runs-fails"],
)
def test_a_figure_beyond_tolerance_is_judged_on_the_median_of_three_runs(
    tiny_model, copy_of, measured, monkeypatch, capsys, slow_runs, code, verdict
) -> None:
    workload = judged_over_three_runs(copy_of)
    slow = slower(measured, "decode", 1.3)
    runs = [slow if i in slow_runs else measured for i in range(3)]
    handed = gate_measuring(monkeypatch, runs)
    assert gate.run_gate(tiny_model, copy_of, threads=1, workload=workload) == code
    out = capsys.readouterr().out
    assert len(handed) == 3 and verdict in out
    assert "decode beyond tolerance in one run: measuring 2 more" in out
    assert "the median figures of 3 runs:" in out


def test_a_run_on_the_wrong_path_fails_without_a_second_look(
    tiny_model, copy_of, measured, monkeypatch, capsys
) -> None:
    workload = judged_over_three_runs(copy_of)
    wrong = replace(slower(measured, "decode", 1.3), path=replace(measured.path, kernels="x"))
    handed = gate_measuring(monkeypatch, [wrong, measured, measured])
    assert gate.run_gate(tiny_model, copy_of, threads=1, workload=workload) == 1
    out = capsys.readouterr().out
    assert len(handed) == 1 and "measuring" not in out and "the kernels ran x" in out


def test_a_passing_run_is_measured_once(tiny_model, copy_of, measured, monkeypatch) -> None:
    workload = judged_over_three_runs(copy_of)
    handed = gate_measuring(monkeypatch, [measured, measured, measured])
    assert gate.run_gate(tiny_model, copy_of, threads=1, workload=workload) == 0
    assert len(handed) == 1


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


def test_calibration_times_a_fixed_amount_of_work() -> None:
    """Its duration grows with its work (16x the steps: no drift of this host reorders that), so it
    measures the machine, not a constant."""
    short, long = calibrate(repeats=3, steps=4), calibrate(repeats=3, steps=64)
    assert 0 < short < long


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


def run_of(calibration: float, prefill: float, memory: float, tokens: list[int]) -> Measurement:
    path = DecodePath("avx2", 10, 10)
    normalised = {"prefill": prefill, "decode": 0.1}
    seconds = {name: value * calibration for name, value in normalised.items()}
    spread = dict.fromkeys(seconds, 0.1)
    return Measurement(calibration, seconds, normalised, spread, memory, path, tokens)


def test_a_re_recorded_baseline_holds_the_median_of_its_runs() -> None:
    # prefill / calibration per run: 2.0, 1.0 (a lucky run), 3.0
    median = Measurement.median(
        [run_of(0.1, 2.0, 100, [1]), run_of(0.2, 1.0, 120, [1]), run_of(0.1, 3.0, 110, [1])]
    )
    figures = median.figures()
    assert figures["prefill"] == pytest.approx(2.0) and median.peak_private_mib == 110
    assert figures["decode"] == pytest.approx(0.1) and median.calibration_s == 0.1
    assert median.path == DecodePath("avx2", 30, 30)


def test_a_measurement_survives_its_json() -> None:
    measurement = run_of(0.1, 2.0, 100, [5, 6])
    assert Measurement.from_json(json.loads(json.dumps(measurement.to_json()))) == measurement


# The files whose changes move what the gate measures: the kernels, the model math, the weight
# formats, the engine (scheduler, runner, sampler) and the gate's own measuring code.
HOT_PATH = (
    "src/rebar/kernels",
    "src/rebar/model",
    "src/rebar/weights",
    "src/rebar/engine",
    "src/rebar_bench/gate_measure.py",
    "src/rebar_bench/offline.py",
)
# The committed baseline may be at most this many commits touching HOT_PATH behind the code it
# judges: past that, a slowdown spread over several small commits could each stay within the
# tolerance of an ever older reference. Re-record it (docs/benchmarks.md) when this test fails.
MAX_HOT_PATH_COMMITS = 8


def git(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True)


def test_the_committed_baseline_is_recent_for_the_hot_path() -> None:
    need_binary("git", "apt-get install git")
    assert (REPO / ".git").exists(), "the suite runs from a git checkout"
    commit = Baseline.read(REPO / "perf" / "baseline.json").data["commit"]
    assert commit["sha"] and commit["dirty"] is False, "record the baseline from a clean tree"
    known = git("cat-file", "-e", f"{commit['sha']}^{{commit}}")
    assert known.returncode == 0, f"the baseline's commit {commit['sha']} is not in this history"
    since = git("rev-list", "--count", f"{commit['sha']}..HEAD", "--", *HOT_PATH)
    assert since.returncode == 0, since.stderr
    behind = int(since.stdout)
    assert behind <= MAX_HOT_PATH_COMMITS, (
        f"perf/baseline.json is {behind} commits touching the hot path behind HEAD (at most "
        f"{MAX_HOT_PATH_COMMITS}): re-record it, docs/benchmarks.md"
    )
