"""What `rebar bench gate` measures, and how each figure is normalised against the machine.

Every time figure is measured `repeats` times and each run is bracketed by a short calibration (a
fixed float32 decoder step on torch's own operators, none of rebar's code): the run's seconds
divided by the mean of the two calibrations around it, and the figure is the median of those
ratios. Alternating the two workloads this closely lets the calibration follow this host's drift
(its speed moves by 2x within minutes), which one calibration before and one after a whole run
cannot.

Besides the figures a measurement records what it ran on, so the gate can refuse a fast run of the
wrong path: the instruction set of rebar's compiled kernels, how many single-stream decode rows went
through the fused decode step (all of them, on the default path) and the greedy tokens of a fixed
prompt.
"""

from __future__ import annotations

import asyncio
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from rebar.engine.core import EngineCore
    from rebar.llm import LLM


@dataclass(frozen=True)
class Workload:
    """What the gate runs; a baseline judges only the workload it was measured on."""

    prompt_tokens: int = 256  # the prefill figure's prompt
    decode_tokens: int = 64  # the decode figure's output
    depth_tokens: int = 3072  # the decode-at-depth figure's context
    depth_decode_tokens: int = 32  # ... and its output
    streams: int = 16  # the batched-decode and p95 figures' requests
    repeats: int = 5  # each time figure is the median of this many calibrated runs
    calibration_steps: int = 32
    serving_requests: int = 8  # streamed one at a time for the serving-overhead figure
    greedy_tokens: int = 32  # the greedy continuation compared with the recorded one
    baseline_runs: int = 3  # a re-recorded baseline holds the median figures of this many runs


# The prompt of the greedy check: plain text, so every model (with or without a chat template)
# takes it.
GREEDY_PROMPT = "The three primary colours are"


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


@dataclass
class Calibrated:
    """Runs of one figure, each divided by the calibration measured right before and after it."""

    steps: int
    seconds: list[float] = field(default_factory=list)
    ratios: list[float] = field(default_factory=list)
    calibrations: list[float] = field(default_factory=list)

    def run(self, measure: Callable[[], float]) -> None:
        before = calibrate(repeats=3, steps=self.steps)
        seconds = measure()
        after = calibrate(repeats=3, steps=self.steps)
        self.seconds.append(seconds)
        self.ratios.append(seconds / ((before + after) / 2))
        self.calibrations += [before, after]


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
import rebar_bench.gate_measure, rebar.config, rebar.llm
torch.set_num_threads({threads})
if {load}:
    from rebar.engine.sampling_params import SamplingParams
    llm = rebar_bench.gate_measure.default_llm({model!r})
    llm.generate("Hello", SamplingParams(max_tokens=1, temperature=0))
print(time.perf_counter() - started, rebar_bench.gate_measure.peak_private_kib(), flush=True)
"""


def peak_private_kib(status: str | None = None) -> int:
    """This process's peak resident KiB less the KiB still mapped from files, from
    /proc/self/status (or the `status` text given)."""
    return _status_kib("VmHWM", status) - _status_kib("RssFile", status)


def private_kib(status: str | None = None) -> int:
    """This process's resident KiB now, less those mapped from files."""
    return _status_kib("VmRSS", status) - _status_kib("RssFile", status)


def _status_kib(field: str, status: str | None) -> int:
    if status is None:
        status = Path("/proc/self/status").read_text()
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return int(fields[field].split()[0])


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


def measure_cold_start(model: str, threads: int, workload: Workload, runs: Calibrated) -> float:
    """`workload.repeats` calibrated runs of a fresh process to its first token (one process's
    start moves by a third on this host, with imports and page-cache reads) into `runs`; returns
    the median peak private memory of those processes above a libraries-only one (MiB)."""
    private: list[float] = []

    def one() -> float:
        _bare_s, bare_mib = _child(model, threads, load=False)
        seconds, loaded_mib = _child(model, threads, load=True)
        private.append(loaded_mib - bare_mib)
        return seconds

    for _ in range(workload.repeats):
        runs.run(one)
    return statistics.median(private)


# ----- the HTTP path: a real `rebar serve` -------------------------------------------------------


MEASURABLE_OVERHEAD_MS = 0.05  # per token; below this the client's clock cannot tell it apart


def serving_overhead_s(url: str, workload: Workload, seed: int) -> float:
    """Seconds the HTTP path adds to each streamed token: `serving_requests` streamed completions
    of `decode_tokens` tokens (/v1/completions: not every model has a chat template), one at a
    time; the client's mean inter-token time minus the mean decode step the server's /metrics
    report over the same requests (`rebar bench serve`'s `serving_overhead_mean_ms`)."""
    from rebar_bench.serve import ServeBenchConfig, run_serve_bench

    config = ServeBenchConfig(
        url,
        endpoint="completions",
        num_prompts=workload.serving_requests,
        input_words=32,
        output_tokens=workload.decode_tokens,
        ignore_eos=True,
        seed=seed,  # new prompts every run: a repeated one is a response-cache hit, no engine step
    )
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


def measure_serving_overhead(
    model: str, threads: int, workload: Workload, runs: Calibrated
) -> None:
    """`serving_overhead_s` of a `rebar serve` with the default settings, once per run."""
    from rebar_bench.rebar_server import rebar_server
    from rebar_bench.serve import ServeBenchConfig, run_serve_bench

    with rebar_server(model, threads) as url:
        warm_up = ServeBenchConfig(url, endpoint="completions", num_prompts=1, seed=99)
        asyncio.run(run_serve_bench(replace(warm_up, output_tokens=8, ignore_eos=True), [1]))
        for repeat in range(workload.repeats):
            runs.run(lambda: serving_overhead_s(url, workload, seed=repeat))  # noqa: B023


# ----- the engine figures: `rebar bench offline`'s measuring code ---------------------------------


class FusedRowCounter:
    """Stands in for the runner's fused decoder and counts the decode rows it is given."""

    def __init__(self, decoder: Any) -> None:
        self.decoder = decoder
        self.max_rows = decoder.max_rows
        self.rows = 0

    def __call__(self, input_ids: torch.Tensor, *args: Any) -> torch.Tensor:
        self.rows += int(input_ids.shape[0])
        return self.decoder(input_ids, *args)


@contextmanager
def counting_fused_rows(core: EngineCore) -> Iterator[FusedRowCounter | None]:
    """The counter while it stands in for `core`'s fused decoder; None when there is none."""
    runner = core.runner
    decoder = runner.fused_decoder
    if decoder is None:
        yield None
        return
    counter = FusedRowCounter(decoder)
    runner.fused_decoder = counter  # type: ignore[assignment]
    try:
        yield counter
    finally:
        runner.fused_decoder = decoder


@dataclass(frozen=True)
class DecodePath:
    """What the single-stream decode figures ran on."""

    kernels: str  # the compiled kernels' instruction set, or "unavailable"
    fused_rows: int  # decode rows the fused step computed
    decode_rows: int  # decode rows those figures produced (tokens after each request's first)

    @property
    def fused(self) -> bool:
        return self.decode_rows > 0 and self.fused_rows == self.decode_rows


def engine_figures(llm: LLM, workload: Workload) -> tuple[dict[str, Calibrated], DecodePath]:
    """Each engine figure's calibrated runs (fresh prompts each run), and the decode path."""
    from rebar.kernels import cpu_quant
    from rebar_bench.offline import run_offline

    core = llm.engine
    assert core is not None, "the gate measures a chat model"
    run_offline(core, num_prompts=1, input_len=8, output_len=2, concurrency=1, seed=99)  # warm-up
    w = workload

    def prefill(seed: int) -> float:
        return run_offline(core, 1, w.prompt_tokens, 1, 1, seed=100 + seed).ttft_ms["p50"] / 1000

    def decode(seed: int) -> float:
        result = run_offline(core, 1, 16, w.decode_tokens, 1, seed=200 + seed)
        return 1 / result.decode_tokens_per_s_per_stream

    def decode_at_depth(seed: int) -> float:
        # The same long prompt every run: after the first, its prefix is cached, and only the
        # decode steps (each attending over the whole context) are timed in any case.
        result = run_offline(core, 1, w.depth_tokens, w.depth_decode_tokens, 1, seed=500)
        return 1 / result.decode_tokens_per_s_per_stream

    def batched_decode(seed: int) -> float:
        # Every stream gets one token per step: a stream's rate is the step rate.
        result = run_offline(core, w.streams, 32, 32, w.streams, seed=300 + seed)
        return 1 / result.decode_tokens_per_s_per_stream

    def p95_latency(seed: int) -> float:
        result = run_offline(core, w.streams, 32, 16, max(1, w.streams // 4), seed=400 + seed)
        return result.e2e_ms["p95"] / 1000

    single_stream = {decode: w.decode_tokens, decode_at_depth: w.depth_decode_tokens}
    figures: dict[str, Calibrated] = {}
    fused_rows = decode_rows = 0
    for measure in (prefill, decode, decode_at_depth, batched_decode, p95_latency):
        runs = figures[measure.__name__] = Calibrated(w.calibration_steps)
        for repeat in range(w.repeats):
            with counting_fused_rows(core) as counter:
                runs.run(lambda: measure(repeat))  # noqa: B023 (run at once)
            if measure in single_stream:
                decode_rows += single_stream[measure] - 1
                fused_rows += counter.rows if counter is not None else 0
    kernels = cpu_quant.isa() if cpu_quant.available() else "unavailable"
    return figures, DecodePath(kernels, fused_rows, decode_rows)


def greedy_tokens(llm: LLM, count: int) -> list[int]:
    """The greedy continuation of GREEDY_PROMPT, `count` tokens (EOS ignored)."""
    from rebar.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=count, temperature=0, ignore_eos=True)
    (output,) = llm.generate(GREEDY_PROMPT, params)
    return list(output.token_ids)


@contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
