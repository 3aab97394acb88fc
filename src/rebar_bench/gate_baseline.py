"""The performance gate's baseline file (perf/baseline.json): its format, what it records, verdicts.

A baseline holds normalised figures (`rebar_bench.gate`) together with what they depend on: the
model, the thread count and the workload (a baseline judges only the same three), and where they
came from: the machine, the commit and, when a re-baseline accepted a regression, the stated
reason. A file without `figures` is a placeholder: the gate refuses to judge against it.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# 4: figures normalised run by run, decode at depth, the decode path and the greedy tokens
FORMAT = 4
# Allowed relative increase of each figure over its baseline, from the noise model measured on the
# 2-core development machine (docs/benchmarks.md, "Noise model"): several gate runs in a row, each
# figure's runs alternated with the calibration, the spread of the normalised figures over those
# runs. Each tolerance is that spread with room to spare, and never above +25% for decode and
# prefill, so a 1.3x slowdown of either fails.
TOLERANCES = {
    "cold_start": 0.30,
    "prefill": 0.25,
    "decode": 0.25,
    "decode_at_depth": 0.25,
    "batched_decode": 0.30,
    "p95_latency": 0.40,
    "peak_private": 0.15,
    # A difference of two means (~0.4 ms a token): the noisiest figure; still fails the ~1 ms a
    # token that HTTP once added.
    "serving_overhead": 1.00,
}
UNITS = dict.fromkeys(TOLERANCES, "x calibration") | {"peak_private": "MiB"}


def record_command(baseline_path: Path) -> str:
    return f"rebar bench gate --update-baseline --baseline {baseline_path}"


class BaselineError(Exception):
    """The baseline cannot judge this run; the message says why and how to re-record it."""


@dataclass(frozen=True)
class Baseline:
    path: Path
    data: dict[str, Any]

    @classmethod
    def read(cls, path: Path) -> Baseline:
        data = json.loads(path.read_text())
        if data.get("format") != FORMAT:
            raise BaselineError(
                f"{path} is in an older format (format {data.get('format', 1)}, this gate reads "
                f"format {FORMAT}). Re-record it on a quiet machine: {record_command(path)}"
            )
        return cls(path, data)

    @property
    def figures(self) -> dict[str, float] | None:
        return self.data.get("figures")

    def mismatch(self, model: str, threads: int, workload: dict[str, int]) -> str | None:
        """Why this baseline cannot judge a run of `model` at `threads` on `workload`, or None."""
        if self.figures is None:
            return f"{self.path} holds no measurement yet"
        recorded = {"model": model, "threads": threads, "workload": workload}
        for key, value in recorded.items():
            if self.data.get(key) != value:
                return f"{self.path} was measured with {key} {self.data.get(key)!r}, not {value!r}"
        return None

    def provenance(self) -> str:
        machine = self.data.get("machine") or {}
        commit = self.data.get("commit") or {}
        sha = (commit.get("sha") or "?")[:12] + (" (dirty)" if commit.get("dirty") else "")
        return (
            f"baseline: commit {sha}, {machine.get('cpu', '?')} x{machine.get('cores', '?')}, "
            f"recorded {self.data.get('recorded_at', '?')}"
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

    @property
    def change(self) -> str:
        return f"{(self.ratio - 1) * 100:+.1f}%"

    def line(self) -> str:
        verdict = "ok  " if self.passed else "FAIL"
        return (
            f"{verdict} {self.figure:<14} {self.measured:10.4g} {UNITS[self.figure]:<14} "
            f"baseline {self.baseline:10.4g}  {self.change:>7} (limit +{self.tolerance * 100:.0f}%)"
        )

    def failure(self) -> str:
        return (
            f"{self.figure} is {(self.ratio - 1) * 100:.1f}% above "
            f"its baseline (limit {self.tolerance * 100:.0f}%)"
        )


GREEDY_CHANGE = "the greedy tokens changed"


def path_failures(measurement: Any, baseline: Baseline | None) -> list[str]:
    """Why `measurement` (a gate Measurement) did not measure what `make run` serves, or differs
    from what `baseline` recorded: the compiled kernels and their instruction set, every
    single-stream decode row on the fused step, the same greedy tokens. Empty when it did."""
    path = measurement.path
    failures = []
    if path.kernels == "unavailable":
        failures.append("rebar's compiled CPU kernels were unavailable")
    if not path.fused:
        failures.append(
            f"decode left the fused step ({path.fused_rows} of {path.decode_rows} single-stream "
            "decode rows on it)"
        )
    if baseline is None:
        return failures
    recorded = baseline.data["raw"]
    if path.kernels != recorded["path"]["kernels"]:
        failures.append(
            f"the kernels ran {path.kernels}, the baseline's {recorded['path']['kernels']}"
        )
    tokens, expected = measurement.greedy_tokens, recorded["greedy_tokens"]
    if tokens != expected:
        at = next((i for i, (a, b) in enumerate(zip(tokens, expected)) if a != b), None)
        at = min(len(tokens), len(expected)) if at is None else at
        failures.append(
            f"{GREEDY_CHANGE} at token {at}: {tokens[at : at + 4]} where the baseline has "
            f"{expected[at : at + 4]}"
        )
    return failures


def judge(
    measured: dict[str, float],
    baseline: dict[str, float],
    tolerances: dict[str, float] = TOLERANCES,
) -> list[Verdict]:
    missing = sorted(set(tolerances) - set(baseline))
    if missing:
        raise BaselineError(f"the baseline lacks {', '.join(missing)}; re-record it")
    return [
        Verdict(name, measured[name], baseline[name], tolerance)
        for name, tolerance in tolerances.items()
    ]


def machine() -> dict[str, Any]:
    """What the figures were measured on (normalisation carries over between machines only
    roughly)."""
    from rebar.kernels import cpu_quant

    return {
        "hostname": platform.node(),
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "kernels": cpu_quant.isa() if cpu_quant.available() else "unavailable",
        "system": platform.platform(),
        "python": platform.python_version(),
        "torch": _torch_version(),
    }


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _torch_version() -> str:
    import torch

    return str(torch.__version__)


def commit() -> dict[str, Any]:
    """The git commit of the rebar sources measured, and whether they had uncommitted changes
    (both None when rebar is not running from a git checkout)."""
    import rebar

    folder = Path(rebar.__file__).resolve().parent

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(
                ["git", "-C", str(folder), *args], capture_output=True, text=True, timeout=30
            )
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    sha = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"sha": sha, "dirty": bool(status) if status is not None else None}


def new_record(
    model: str,
    threads: int,
    workload: dict[str, int],
    figures: dict[str, float],
    raw: dict[str, Any],
    accepted_regression: dict[str, Any] | None,
) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "model": model,
        "threads": threads,
        "workload": workload,
        "figures": figures,
        "raw": raw,
        "machine": machine(),
        "commit": commit(),
        "recorded_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "accepted_regression": accepted_regression,
    }
