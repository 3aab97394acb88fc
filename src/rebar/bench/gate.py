"""`rebar bench gate`: a performance gate for CI on noisy machines.

Three figures, each normalised by a calibration measured in the same run, so a slower (or busier)
machine moves the calibration and the figure together:

- `cold_start`: seconds from spawning a fresh Python process to its first generated token
  (imports, model load, KV-cache allocation, one prefill), divided by the calibration time;
- `p95_latency`: p95 end-to-end latency of a fixed small workload on the engine (16 requests,
  32 prompt + 16 output tokens, 4 at a time), divided by the calibration time;
- `peak_rss`: the cold-start process's peak resident memory minus that of a process that only
  imported the same libraries (MiB) — memory does not depend on speed, the baseline removes the
  interpreter and libraries.

The calibration is a fixed synthetic decoder step (random weights shaped like a small Llama) run
with the same thread count: the same operators, so it slows down with the workload. Everything runs
on one thread by default: with two or more, a busy machine stalls every parallel operator's barrier
for a scheduler time slice whenever another process holds a core, which slows the figures by a
factor that has nothing to do with the code under test. Each figure is
compared with a committed baseline (`perf/baseline.json`); one beyond its tolerance fails the gate
and the output says which one and by how much.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

TOLERANCES = {
    "cold_start": 0.35,
    "p95_latency": 0.35,
    "peak_rss": 0.15,
}  # allowed relative increase
UNITS = {"cold_start": "x calibration", "p95_latency": "x calibration", "peak_rss": "MiB"}


def calibrate(repeats: int = 7, steps: int = 32) -> float:
    """Median seconds of `steps` batch-1 steps of a 4-layer random decoder (hidden 576, MLP 1536)."""
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


@dataclass(frozen=True)
class ColdStart:
    seconds: float
    peak_rss_mib: float


_CHILD = """
import resource, sys, time
started = time.perf_counter()
{imports}
torch.set_num_threads({threads})
if {load}:
    from rebar.engine.llm import LLM
    from rebar.engine.sampling_params import SamplingParams
    llm = LLM({model!r}, engine_config=__import__("rebar.engine.engine_config", fromlist=["x"]).EngineConfig(max_model_len=512))
    llm.generate("Hello", SamplingParams(max_tokens=1, temperature=0))
print(time.perf_counter() - started, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, flush=True)
"""


def _child(model: str, load: bool) -> ColdStart:
    imports = "import torch, numpy, rebar.engine.llm"
    code = _CHILD.format(imports=imports, load=load, model=model, threads=torch.get_num_threads())
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"cold-start process failed:\n{done.stderr[-2000:]}")
    _inner, max_rss_kib = done.stdout.split()[-2:]
    return ColdStart(wall, int(max_rss_kib) / 1024)


def measure_cold_start(model: str) -> tuple[float, float]:
    """(seconds to the first token of a fresh process, its peak RSS above a libraries-only process in MiB)."""
    bare = _child(model, load=False)
    loaded = _child(model, load=True)
    return loaded.seconds, loaded.peak_rss_mib - bare.peak_rss_mib


def measure_p95_latency(model: str) -> float:
    """p95 end-to-end seconds of the fixed workload, after one warm-up request."""
    from rebar.bench.offline import run_offline
    from rebar.engine.engine_config import EngineConfig
    from rebar.engine.llm import LLM

    llm = LLM(model, engine_config=EngineConfig(max_num_seqs=4, max_model_len=512))
    run_offline(llm.engine, num_prompts=1, input_len=8, output_len=2, concurrency=1, seed=1)
    result = run_offline(
        llm.engine, num_prompts=16, input_len=32, output_len=16, concurrency=4, seed=0
    )
    return result.e2e_ms["p95"] / 1000


@dataclass(frozen=True)
class GateFigures:
    calibration_s: float
    cold_start_s: float
    p95_latency_s: float
    cold_start: float  # normalised
    p95_latency: float  # normalised
    peak_rss: float  # MiB above the libraries-only process

    def normalised(self) -> dict[str, float]:
        return {
            "cold_start": self.cold_start,
            "p95_latency": self.p95_latency,
            "peak_rss": self.peak_rss,
        }


def measure(model: str) -> GateFigures:
    # Calibrate before and after, and use the mean: the machine's load can drift during the run.
    before = calibrate()
    cold_start_s, rss = measure_cold_start(model)
    p95 = measure_p95_latency(model)
    calibration = (before + calibrate()) / 2
    return GateFigures(
        calibration, cold_start_s, p95, cold_start_s / calibration, p95 / calibration, rss
    )


@dataclass(frozen=True)
class Verdict:
    figure: str
    measured: float
    baseline: float
    tolerance: float

    @property
    def ratio(self) -> float:
        return self.measured / self.baseline if self.baseline else float("inf")

    @property
    def passed(self) -> bool:
        return self.ratio <= 1 + self.tolerance

    def line(self) -> str:
        verdict = "ok  " if self.passed else "FAIL"
        change = (self.ratio - 1) * 100
        return (
            f"{verdict} {self.figure:<12} {self.measured:10.2f} {UNITS[self.figure]:<14} baseline {self.baseline:10.2f}  "
            f"{change:+6.1f}% (limit +{self.tolerance * 100:.0f}%)"
        )


def judge(
    measured: dict[str, float],
    baseline: dict[str, float],
    tolerances: dict[str, float] = TOLERANCES,
) -> list[Verdict]:
    missing = sorted(set(tolerances) - set(baseline))
    if missing:
        raise ValueError(
            f"baseline lacks {', '.join(missing)}; regenerate it with --update-baseline"
        )
    return [
        Verdict(name, measured[name], baseline[name], tolerance)
        for name, tolerance in tolerances.items()
    ]


def run_gate(model: str, baseline_path: Path, update: bool = False, threads: int = 1) -> int:
    if not update and not baseline_path.exists():
        print(
            f"no baseline at {baseline_path}: measure one on a quiet machine with --update-baseline "
            "(and check that the gate then passes twice) before the gate can judge anything"
        )
        return 2
    if not update:
        recorded = json.loads(baseline_path.read_text()).get("threads", 1)
        if recorded != threads:
            raise ValueError(f"the baseline was measured with {recorded} thread(s), not {threads}")
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        figures = measure(model)
    finally:
        torch.set_num_threads(previous)
    print(
        f"calibration {figures.calibration_s * 1e3:.1f} ms; cold start {figures.cold_start_s:.2f} s; "
        f"p95 latency {figures.p95_latency_s * 1e3:.0f} ms (threads {threads})"
    )
    if update:
        baseline_path.parent.mkdir(parents=True, exist_ok=True)
        record = {
            "model": model,
            "threads": threads,
            "figures": figures.normalised(),
            "raw": asdict(figures),
        }
        baseline_path.write_text(json.dumps(record, indent=2) + "\n")
        print(f"baseline written to {baseline_path}")
        return 0
    baseline = json.loads(baseline_path.read_text())
    if baseline.get("model") != model:
        raise ValueError(f"the baseline was measured on {baseline.get('model')!r}, not {model!r}")
    verdicts = judge(figures.normalised(), baseline["figures"])
    for verdict in verdicts:
        print(verdict.line())
    failed = [v for v in verdicts if not v.passed]
    if failed:
        print(
            "performance gate FAILED: "
            + "; ".join(
                f"{v.figure} is {(v.ratio - 1) * 100:.1f}% above its baseline (limit {v.tolerance * 100:.0f}%)"
                for v in failed
            )
        )
        return 1
    print("performance gate passed")
    return 0
