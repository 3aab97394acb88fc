"""`rebar bench gate`: a performance gate for CI on noisy machines.

It measures what `make run` serves: the chat model loaded with the default settings (GGUF weights
kept quantized on rebar's CPU kernels, the fused decode step, the float16 KV cache) at the default
thread count (torch's, as `rebar serve` leaves it). Seven figures, every time figure divided by a
calibration measured in the same run at the same thread count, so a slower (or busier) machine
moves the calibration and the figure together:

- `cold_start`: a fresh Python process spawned to its first generated token (imports, model load,
  KV-cache allocation, one prefill);
- `prefill`: time to the first token of one `prompt_tokens` prompt;
- `decode`: seconds per token of one stream (the fused step at one row, the quantized lm_head);
- `batched_decode`: seconds per decode step of `streams` streams at once (the fused step's rows
  split over the threads);
- `p95_latency`: p95 end-to-end latency of `streams` requests (32 prompt + 16 output tokens),
  a quarter of them at a time;
- `serving_overhead`: what the HTTP path adds to each streamed token at one stream: a `rebar serve`
  with the default settings, the client's mean inter-token time minus the mean decode step the
  server's own /metrics report over the same requests;
- `peak_private`: the cold-start process's peak private memory (resident memory less the pages
  mapped from files) minus that of a process that only imported the same libraries (MiB).

The calibration is a fixed float32 decoder step (random weights shaped like a small Llama) on
torch's own operators: none of rebar's code, so a regression in rebar cannot hide in it, and the
same threads, so it slows down with the machine. The engine figures are medians of `repeats` runs
of `rebar bench offline`'s code, cold start and peak memory medians of `repeats` fresh processes.
Each figure is compared with a committed baseline (`perf/baseline.json`,
`rebar_bench.gate_baseline`); one beyond its tolerance fails the gate and the output says which
one and by how much.

Re-baselining (`update=True`) measures the same way and then judges the fresh figures against the
current baseline: a regression is refused unless `accept_regression` states why, and that reason
is recorded in the file with the machine and the commit.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rebar_bench.gate_baseline import (
    Baseline,
    BaselineError,
    Verdict,
    judge,
    new_record,
    record_command,
)

if TYPE_CHECKING:
    from rebar.engine.core import EngineCore
    from rebar.llm import LLM


@dataclass(frozen=True)
class Workload:
    """What the gate runs; a baseline judges only the workload it was measured on."""

    prompt_tokens: int = 256  # the prefill figure's prompt
    decode_tokens: int = 64  # the decode figure's output
    streams: int = 16  # the batched-decode and p95 figures' requests
    repeats: int = 3  # engine figures are medians of this many runs
    calibration_steps: int = 32
    serving_requests: int = 8  # streamed one at a time for the serving-overhead figure
    baseline_runs: int = 3  # a re-recorded baseline holds the median figures of this many runs


def calibrate(repeats: int = 7, steps: int = 32) -> float:
    """Median seconds of `steps` batch-1 steps of a 4-layer random decoder (hidden 576,
    MLP 1536)."""
    generator = torch.Generator().manual_seed(0)

    def weight(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=generator) * 0.02

    layers = [
        (weight(576, 1152), weight(576, 576), weight(576, 3072), weight(1536, 576))
        for _ in range(4)
    ]
    x0 = torch.randn(1, 576, generator=generator)

    def run() -> float:
        started = time.perf_counter()
        with torch.inference_mode():
            x = x0
            for _ in range(steps):
                for qkv, out, gate_up, down in layers:
                    h = torch.nn.functional.rms_norm(x, (576,))
                    x = x + (h @ qkv)[:, :576] @ out
                    gate, up = (torch.nn.functional.rms_norm(x, (576,)) @ gate_up).chunk(2, dim=-1)
                    x = x + (torch.nn.functional.silu(gate) * up) @ down
        return time.perf_counter() - started

    run()  # first-call allocations
    return statistics.median(run() for _ in range(repeats))


def default_llm(model: str) -> LLM:
    """`model` loaded as `rebar serve` loads its chat model when no setting is given."""
    from rebar.config import Settings
    from rebar.llm import LLM

    return LLM.from_settings(model, Settings())  # every setting its default


# ----- cold start and memory: fresh processes ----------------------------------------------------

# The peak comes from VmHWM, which starts afresh at exec; getrusage's ru_maxrss keeps the parent's
# peak across fork + exec, so a child smaller than the gate's own process would read the gate's.
# VmHWM also counts pages mapped from files (shared libraries, the mmapped GGUF), and how many of
# those a process maps depends on the page cache, not on rebar: the same process mapped 141 MiB of
# library pages from a freshly installed venv and 82 MiB from an older one. So the file-backed pages
# still mapped at the end are taken off: mapped files stay mapped, so what is left lies between the
# private memory at the end and its peak.
_CHILD = """
import time
started = time.perf_counter()
import numpy, torch
import rebar_bench.gate, rebar.config, rebar.llm
torch.set_num_threads({threads})
if {load}:
    from rebar.engine.sampling_params import SamplingParams
    llm = rebar_bench.gate.default_llm({model!r})
    llm.generate("Hello", SamplingParams(max_tokens=1, temperature=0))
print(time.perf_counter() - started, rebar_bench.gate.peak_private_kib(), flush=True)
"""


def peak_private_kib(status: str | None = None) -> int:
    """This process's peak resident KiB less the KiB still mapped from files, from
    /proc/self/status (or the `status` text given)."""
    if status is None:
        status = Path("/proc/self/status").read_text()
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return int(fields["VmHWM"].split()[0]) - int(fields["RssFile"].split()[0])


def _child(model: str, threads: int, load: bool) -> tuple[float, float]:
    """(seconds from spawning the process to its exit, its peak private memory in MiB)."""
    code = _CHILD.format(load=load, model=model, threads=threads)
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"cold-start process failed:\n{done.stderr[-2000:]}")
    _inner, peak_kib = done.stdout.split()[-2:]
    return wall, int(peak_kib) / 1024


def measure_cold_start(model: str, threads: int, repeats: int) -> tuple[float, float]:
    """(seconds to the first token of a fresh process, its peak private memory above a
    libraries-only one in MiB), medians of `repeats` pairs of processes: one process's start
    moves by a third on this host, with imports and page-cache reads that no calibration tracks."""
    pairs = [
        (_child(model, threads, load=False), _child(model, threads, load=True))
        for _ in range(repeats)
    ]
    seconds = statistics.median(loaded[0] for _bare, loaded in pairs)
    private = statistics.median(loaded[1] - bare[1] for bare, loaded in pairs)
    return seconds, private


# ----- the HTTP path: a real `rebar serve` -------------------------------------------------------


MEASURABLE_OVERHEAD_MS = 0.05  # per token; below this the client's clock cannot tell it apart


def measure_serving_overhead(model: str, threads: int, workload: Workload) -> float:
    """Seconds the HTTP path adds to each streamed token: `serving_requests` streamed completions
    of `decode_tokens` tokens (/v1/completions: not every model has a chat template), one at a
    time, to a `rebar serve` with the default settings; the client's mean inter-token time minus
    the mean decode step the server's /metrics report over the same requests (`rebar bench
    serve`'s `serving_overhead_mean_ms`)."""
    from rebar_bench.rebar_server import rebar_server
    from rebar_bench.serve import ServeBenchConfig, run_serve_bench

    with rebar_server(model, threads) as url:
        config = ServeBenchConfig(
            url,
            endpoint="completions",
            num_prompts=workload.serving_requests,
            input_words=32,
            output_tokens=workload.decode_tokens,
            ignore_eos=True,
        )
        asyncio.run(run_serve_bench(replace(config, num_prompts=1, seed=99), [1]))  # warm-up
        level = asyncio.run(run_serve_bench(config, [1])).levels[0]
    overhead_ms = level.serving_overhead_mean_ms
    if level.num_failed or overhead_ms is None:
        raise RuntimeError(
            "the serving-overhead run failed: "
            f"{level.error_examples or 'no engine step in /metrics'}"
        )
    # A difference of two means can come out at or below zero when the path adds next to nothing
    # (a tiny model); the floor keeps a figure, and so a baseline and its limit, above zero.
    return max(overhead_ms, MEASURABLE_OVERHEAD_MS) / 1000


# ----- the engine figures: `rebar bench offline`'s measuring code ---------------------------------


def measure_engine(llm: LLM, workload: Workload) -> dict[str, float]:
    """Seconds of each engine figure, medians of `workload.repeats` runs with fresh prompts."""
    from rebar_bench.offline import run_offline

    core = llm.engine
    assert core is not None, "the gate measures a chat model"
    run_offline(core, num_prompts=1, input_len=8, output_len=2, concurrency=1, seed=99)  # warm-up
    w = workload

    def prefill(core: EngineCore, seed: int) -> float:
        result = run_offline(core, 1, w.prompt_tokens, 1, 1, seed=100 + seed)
        return result.ttft_ms["p50"] / 1000

    def decode(core: EngineCore, seed: int) -> float:
        result = run_offline(core, 1, 16, w.decode_tokens, 1, seed=200 + seed)
        return 1 / result.decode_tokens_per_s_per_stream

    def batched_decode(core: EngineCore, seed: int) -> float:
        # Every stream gets one token per step: a stream's rate is the step rate.
        result = run_offline(core, w.streams, 32, 32, w.streams, seed=300 + seed)
        return 1 / result.decode_tokens_per_s_per_stream

    def p95_latency(core: EngineCore, seed: int) -> float:
        result = run_offline(core, w.streams, 32, 16, max(1, w.streams // 4), seed=400 + seed)
        return result.e2e_ms["p95"] / 1000

    figures: tuple[Callable[[EngineCore, int], float], ...] = (
        prefill,
        decode,
        batched_decode,
        p95_latency,
    )
    return {f.__name__: statistics.median(f(core, r) for r in range(w.repeats)) for f in figures}


@dataclass(frozen=True)
class Measurement:
    calibration_s: float
    seconds: dict[str, float]  # cold_start and the engine figures
    peak_private_mib: float  # above the libraries-only process
    fused_decode: bool  # whether decode steps ran on the fused CPU step

    def figures(self) -> dict[str, float]:
        """The judged figures: every time divided by the calibration, memory in MiB."""
        normalised = {name: s / self.calibration_s for name, s in self.seconds.items()}
        return normalised | {"peak_private": self.peak_private_mib}

    @classmethod
    def median(cls, runs: list[Measurement]) -> Measurement:
        """The measurement whose figures are the medians of the runs' figures (its seconds are
        those figures at the median calibration): one lucky or unlucky run never makes a
        baseline."""
        calibration = statistics.median(r.calibration_s for r in runs)
        seconds = {
            name: statistics.median(r.seconds[name] / r.calibration_s for r in runs) * calibration
            for name in runs[0].seconds
        }
        memory = statistics.median(r.peak_private_mib for r in runs)
        return cls(calibration, seconds, memory, all(r.fused_decode for r in runs))


@contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def measure(model: str, workload: Workload, threads: int) -> Measurement:
    from rebar.kernels import cpu_quant

    cpu_quant.available()  # build the kernels now, if they must be: a build is no cold start
    with torch_threads(threads):
        # Calibrate before and after, and use the mean: the machine's load can drift during the run.
        before = calibrate(steps=workload.calibration_steps)
        cold_start_s, private = measure_cold_start(model, threads, workload.repeats)
        serving_s = measure_serving_overhead(model, threads, workload)
        llm = default_llm(model)
        seconds = {"cold_start": cold_start_s, "serving_overhead": serving_s}
        seconds |= measure_engine(llm, workload)
        calibration = (before + calibrate(steps=workload.calibration_steps)) / 2
    fused = llm.engine is not None and llm.engine.runner.fused_decoder is not None
    return Measurement(calibration, seconds, private, fused)


# ----- the gate -----------------------------------------------------------------------------------


def run_gate(
    model: str,
    baseline_path: Path,
    update: bool = False,
    threads: int | None = None,
    workload: Workload = Workload(),
    accept_regression: str | None = None,
) -> int:
    """Judge (or, with `update`, re-record) the baseline; 0 passed, 1 regressed, 2 cannot judge."""
    threads = threads or torch.get_num_threads()
    if accept_regression is not None and not (update and accept_regression.strip()):
        print("--accept-regression needs --update-baseline and a non-empty reason")
        return 2
    missing = f"no baseline at {baseline_path}"
    try:
        baseline = Baseline.read(baseline_path) if baseline_path.exists() else None
    except BaselineError as exc:
        if not update:
            print(f"performance gate cannot judge: {exc}")
            return 2
        print(f"re-recording: {exc}")
        baseline, missing = None, f"{baseline_path} is in an older format"
    mismatch = baseline.mismatch(model, threads, asdict(workload)) if baseline else missing
    if mismatch and not update:
        print(
            f"performance gate cannot judge: {mismatch}: record one on a quiet machine with "
            f"`{record_command(baseline_path)}` (docs/benchmarks.md)"
        )
        return 2
    if baseline is not None and not mismatch:
        print(baseline.provenance())
    elif update:
        print(f"nothing to compare the new baseline with: {mismatch}")
    runs = workload.baseline_runs if update else 1
    measurements = [measure(model, workload, threads) for _ in range(runs)]
    for run in measurements:
        _report(run, threads)
    measurement = Measurement.median(measurements)
    if runs > 1:
        print(f"the median figures of {runs} runs:")
        _report(measurement, threads)
    verdicts = [] if mismatch or baseline is None else _verdicts(baseline, measurement)
    failed = [v for v in verdicts if not v.passed]
    if update:
        return _rebaseline(
            baseline_path, model, threads, workload, measurement, failed, accept_regression
        )
    if failed:
        print("performance gate FAILED: " + "; ".join(v.failure() for v in failed))
        return 1
    print("performance gate passed")
    return 0


def _verdicts(baseline: Baseline, measurement: Measurement) -> list[Verdict]:
    assert baseline.figures is not None, "a baseline without figures judges nothing"
    verdicts = judge(measurement.figures(), baseline.figures)
    for verdict in verdicts:
        print(verdict.line())
    return verdicts


def _report(measurement: Measurement, threads: int) -> None:
    seconds = ", ".join(f"{name} {s * 1e3:.1f} ms" for name, s in measurement.seconds.items())
    path = "fused decode step" if measurement.fused_decode else "NO fused decode step"
    print(
        f"threads {threads}, {path}; calibration {measurement.calibration_s * 1e3:.1f} ms; "
        f"{seconds}; peak private memory {measurement.peak_private_mib:.0f} MiB above the libraries"
    )


def _rebaseline(
    path: Path,
    model: str,
    threads: int,
    workload: Workload,
    measurement: Measurement,
    failed: list[Verdict],
    accept_regression: str | None,
) -> int:
    accepted = None
    if failed and accept_regression is None:
        print(
            "refusing to re-baseline: the fresh measurement "
            "regresses against the current baseline ("
            + "; ".join(v.failure() for v in failed)
            + "). Rerun on a quiet machine, or state why the regression is accepted with "
            "--accept-regression 'REASON' (recorded in the baseline)."
        )
        return 1
    if failed:
        accepted = {"reason": accept_regression, "figures": {v.figure: v.change for v in failed}}
    raw: dict[str, Any] = asdict(measurement)
    record = new_record(model, threads, asdict(workload), measurement.figures(), raw, accepted)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(f"baseline written to {path}")
    return 0
