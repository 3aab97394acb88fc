"""`rebar bench gate`: a performance gate for CI on noisy machines.

It measures what `make run` serves: the chat model loaded with the default settings (GGUF weights
kept quantized on rebar's CPU kernels, the fused decode step, the float16 KV cache) at the default
thread count (torch's, as `rebar serve` leaves it). Eight figures; every time figure is measured
`repeats` times, each run divided by a calibration measured right before and after it at the same
thread count (rebar_bench.gate_measure), so a slower (or busier) machine moves the calibration and
the figure together:

- `cold_start`: a fresh Python process spawned to its first generated token (imports, model load,
  KV-cache allocation, one prefill);
- `prefill`: time to the first token of one `prompt_tokens` prompt;
- `decode`: seconds per token of one stream (the fused step at one row, the quantized lm_head);
- `decode_at_depth`: the same with `depth_tokens` of context (attention over a long KV cache);
- `batched_decode`: seconds per decode step of `streams` streams at once (the fused step's rows
  split over the threads);
- `p95_latency`: p95 end-to-end latency of `streams` requests (32 prompt + 16 output tokens),
  a quarter of them at a time;
- `serving_overhead`: what the HTTP path adds to each streamed token at one stream: a `rebar serve`
  with the default settings, the client's mean inter-token time minus the mean decode step the
  server's own /metrics report over the same requests;
- `peak_private`: the cold-start process's peak private memory (resident memory less the pages
  mapped from files) minus that of a process that only imported the same libraries (MiB).

The gate also checks that it measured the right thing: rebar's compiled kernels built for the
baseline's instruction set, every single-stream decode row on the fused decode step, and the same
greedy tokens for a fixed prompt as the baseline recorded; any difference fails it, however fast.

Each figure is compared with a committed baseline (`perf/baseline.json`,
`rebar_bench.gate_baseline`). A run with a figure beyond its tolerance is followed by
`baseline_runs - 1` more, and the gate fails when a figure's median over them (the statistic the
baseline records) is still beyond it; the output says which one and by how much. `run_noise`
measures the spread the tolerances rest on.

Re-baselining (`update=True`) measures the same way and then judges the fresh figures against the
current baseline: a regression (or changed greedy tokens) is refused unless `accept_regression`
states why, and that reason is recorded in the file with the machine and the commit; a run off the
default path is never recorded.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from rebar_bench.gate_baseline import (
    GREEDY_CHANGE,
    Baseline,
    BaselineError,
    Verdict,
    judge,
    new_record,
    path_failures,
    record_command,
)
from rebar_bench.gate_measure import (
    Calibrated,
    DecodePath,
    Workload,
    calibrate,
    default_llm,
    engine_figures,
    greedy_tokens,
    measure_cold_start,
    measure_serving_overhead,
    peak_private_kib,
    torch_threads,
)

__all__ = ["Measurement", "Workload", "calibrate", "default_llm", "peak_private_kib", "run_gate"]


@dataclass(frozen=True)
class Measurement:
    """One gate run: its figures, what they ran on and the greedy tokens."""

    calibration_s: float  # the median of every calibration of the run
    seconds: dict[str, float]  # each time figure's median seconds
    normalised: dict[str, float]  # each time figure's median of its runs' seconds / calibration
    spread: dict[str, float]  # each time figure: its slowest run's ratio over its fastest, less 1
    peak_private_mib: float  # above the libraries-only process
    path: DecodePath
    greedy_tokens: list[int]

    def figures(self) -> dict[str, float]:
        """The judged figures: times normalised by their calibrations, memory in MiB."""
        return self.normalised | {"peak_private": self.peak_private_mib}

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Measurement:
        return cls(**(data | {"path": DecodePath(**data["path"])}))

    @classmethod
    def median(cls, runs: list[Measurement]) -> Measurement:
        """The measurement whose figures are the medians of the runs' figures: one lucky or unlucky
        run never makes a baseline. Its path adds the runs' rows up; kernels and tokens are the
        first run's (path_failures judges every run's own)."""
        names = runs[0].seconds
        return cls(
            statistics.median(r.calibration_s for r in runs),
            {name: statistics.median(r.seconds[name] for r in runs) for name in names},
            {name: statistics.median(r.normalised[name] for r in runs) for name in names},
            {name: max(r.spread[name] for r in runs) for name in names},
            statistics.median(r.peak_private_mib for r in runs),
            DecodePath(
                runs[0].path.kernels,
                sum(r.path.fused_rows for r in runs),
                sum(r.path.decode_rows for r in runs),
            ),
            runs[0].greedy_tokens,
        )


def _summarise(figures: dict[str, Calibrated]) -> tuple[dict[str, float], ...]:
    seconds = {name: statistics.median(runs.seconds) for name, runs in figures.items()}
    normalised = {name: statistics.median(runs.ratios) for name, runs in figures.items()}
    spread = {name: max(runs.ratios) / min(runs.ratios) - 1 for name, runs in figures.items()}
    return seconds, normalised, spread


def measure(model: str, workload: Workload, threads: int) -> Measurement:
    from rebar.kernels import cpu_quant

    cpu_quant.available()  # build the kernels now, if they must be: a build is no cold start
    with torch_threads(threads):
        figures = {"cold_start": Calibrated(workload.calibration_steps)}
        private = measure_cold_start(model, threads, workload, figures["cold_start"])
        figures["serving_overhead"] = Calibrated(workload.calibration_steps)
        measure_serving_overhead(model, threads, workload, figures["serving_overhead"])
        llm = default_llm(model)
        engine, path = engine_figures(llm, workload)
        figures |= engine
        tokens = greedy_tokens(llm, workload.greedy_tokens)
    seconds, normalised, spread = _summarise(figures)
    calibrations = [c for runs in figures.values() for c in runs.calibrations]
    calibration = statistics.median(calibrations)
    return Measurement(calibration, seconds, normalised, spread, private, path, tokens)


# ----- the gate -----------------------------------------------------------------------------------


def run_gate(
    model: str,
    baseline_path: Path,
    update: bool = False,
    threads: int | None = None,
    workload: Workload = Workload(),
    accept_regression: str | None = None,
) -> int:
    """Judge (or, with `update`, re-record) the baseline; 0 passed, 1 failed, 2 cannot judge."""
    threads = threads or torch.get_num_threads()
    if accept_regression is not None and not (update and accept_regression.strip()):
        print("--accept-regression needs --update-baseline and a non-empty reason")
        return 2
    try:
        baseline, mismatch = _comparable_baseline(baseline_path, model, threads, workload, update)
    except BaselineError:
        return 2
    runs = workload.baseline_runs if update else 1
    measurements = [measure(model, workload, threads) for _ in range(runs)]
    for run in measurements:
        _report(run, threads)
    measurement = Measurement.median(measurements)
    if runs > 1:
        _noise_table(measurements)
        print(f"the median figures of {runs} runs:")
        _report(measurement, threads)
    comparable = None if mismatch else baseline
    wrong_path = [f for run in measurements for f in path_failures(run, comparable)]
    verdicts = [] if comparable is None else _verdicts(comparable, measurement)
    failed = [v for v in verdicts if not v.passed]
    may_look_again = workload.baseline_runs > 1 and not update and not wrong_path
    if failed and may_look_again and comparable is not None:
        measurements += _second_look(model, workload, threads, failed)
        measurement = Measurement.median(measurements)
        _noise_table(measurements)
        print(f"the median figures of {len(measurements)} runs:")
        _report(measurement, threads)
        wrong_path = [f for run in measurements for f in path_failures(run, comparable)]
        failed = [v for v in _verdicts(comparable, measurement) if not v.passed]
    if update:
        return _rebaseline(
            baseline_path,
            model,
            threads,
            workload,
            measurement,
            failed,
            wrong_path,
            accept_regression,
        )
    problems = sorted(set(wrong_path)) + [v.failure() for v in failed]
    if problems:
        print("performance gate FAILED: " + "; ".join(problems))
        return 1
    print("performance gate passed")
    return 0


def _second_look(
    model: str, workload: Workload, threads: int, failed: list[Verdict]
) -> list[Measurement]:
    """The runs that join a judged run whose figures fell outside their tolerances: the figures are
    then judged as the baseline's were recorded, the medians of `baseline_runs` runs.

    This host's speed moves by up to 30% within minutes with no change in rebar (one CI gate read
    +27% of a +30% tolerance on batched decode, gates on the same code minutes later +1% and +7%),
    so one run caught at a bad moment fails a figure that the median of three does not; a real
    regression moves every run, and their median with it. A wrong path (other kernels, decode rows
    off the fused step, other greedy tokens) fails at once: more runs could not change it.
    """
    extra = workload.baseline_runs - 1
    names = ", ".join(v.figure for v in failed)
    print(
        f"{names} beyond tolerance in one run: measuring {extra} more and judging the medians of "
        f"{extra + 1} runs, as the baseline was recorded"
    )
    runs = [measure(model, workload, threads) for _ in range(extra)]
    for run in runs:
        _report(run, threads)
    return runs


def _comparable_baseline(
    baseline_path: Path, model: str, threads: int, workload: Workload, update: bool
) -> tuple[Baseline | None, str | None]:
    """The recorded baseline and why it cannot judge this run (None when it can); raises
    BaselineError, having said why, when the gate cannot judge and is not re-recording."""
    missing = f"no baseline at {baseline_path}"
    try:
        baseline = Baseline.read(baseline_path) if baseline_path.exists() else None
    except BaselineError as exc:
        if not update:
            print(f"performance gate cannot judge: {exc}")
            raise
        print(f"re-recording: {exc}")
        baseline, missing = None, f"{baseline_path} is in an older format"
    mismatch = baseline.mismatch(model, threads, asdict(workload)) if baseline else missing
    if mismatch and not update:
        print(
            f"performance gate cannot judge: {mismatch}: record one on a quiet machine with "
            f"`{record_command(baseline_path)}` (docs/benchmarks.md)"
        )
        raise BaselineError(mismatch)
    if baseline is not None and not mismatch:
        print(baseline.provenance())
    elif update:
        print(f"nothing to compare the new baseline with: {mismatch}")
    return baseline, mismatch


def _verdicts(baseline: Baseline, measurement: Measurement) -> list[Verdict]:
    assert baseline.figures is not None, "a baseline without figures judges nothing"
    verdicts = judge(measurement.figures(), baseline.figures)
    for verdict in verdicts:
        print(verdict.line())
    return verdicts


def _report(measurement: Measurement, threads: int) -> None:
    seconds = ", ".join(
        f"{name} {s * 1e3:.1f} ms (runs within {measurement.spread[name] * 100:.0f}%)"
        for name, s in measurement.seconds.items()
    )
    path = measurement.path
    print(
        f"threads {threads}, kernels {path.kernels}, {path.fused_rows} of {path.decode_rows} "
        f"single-stream decode rows on the fused step; calibration "
        f"{measurement.calibration_s * 1e3:.1f} ms; {seconds}; peak private memory "
        f"{measurement.peak_private_mib:.0f} MiB above the libraries"
    )


def _rebaseline(
    path: Path,
    model: str,
    threads: int,
    workload: Workload,
    measurement: Measurement,
    failed: list[Verdict],
    wrong_path: list[str],
    accept_regression: str | None,
) -> int:
    unrecordable = [p for p in wrong_path if not p.startswith(GREEDY_CHANGE)]
    if unrecordable:  # a baseline of the wrong path would judge nothing that `make run` serves
        print("refusing to re-baseline: " + "; ".join(sorted(set(unrecordable))))
        return 1
    changes = [v.failure() for v in failed] + sorted(set(wrong_path))
    if changes and accept_regression is None:
        print(
            "refusing to re-baseline: the fresh measurement differs from the current baseline ("
            + "; ".join(changes)
            + "). Rerun on a quiet machine, or state why the change is accepted with "
            "--accept-regression 'REASON' (recorded in the baseline)."
        )
        return 1
    accepted = None
    if changes:
        figures: dict[str, str] = {v.figure: v.change for v in failed}
        if wrong_path:
            figures["greedy_tokens"] = "changed"
        accepted = {"reason": accept_regression, "figures": figures}
    record = new_record(
        model, threads, asdict(workload), measurement.figures(), measurement.to_json(), accepted
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(f"baseline written to {path}")
    return 0


def run_noise(model: str, runs: int, threads: int | None, workload: Workload = Workload()) -> int:
    """Measure `runs` times, judging nothing, and print each figure's spread: the noise model
    the tolerances rest on (docs/benchmarks.md)."""
    threads = threads or torch.get_num_threads()
    measurements = [measure(model, workload, threads) for _ in range(runs)]
    for run in measurements:
        _report(run, threads)
    _noise_table(measurements)
    return 0


def _noise_table(measurements: list[Measurement]) -> None:
    """Each figure over the runs: min, median, max, and the spread within a run's repeats."""
    print(f"{'figure':<17}{'min':>10}{'median':>10}{'max':>10}  max/median  max/min  in-run")
    for name in measurements[0].figures():
        values = [m.figures()[name] for m in measurements]
        middle = statistics.median(values)
        in_run = max(m.spread.get(name, 0.0) for m in measurements)
        above_median = (max(values) / middle - 1) * 100
        above_min = (max(values) / min(values) - 1) * 100
        print(
            f"{name:<17}{min(values):10.4g}{middle:10.4g}{max(values):10.4g}  "
            f"{above_median:+9.1f}%  {above_min:+6.1f}%  {in_run * 100:+5.1f}%"
        )
