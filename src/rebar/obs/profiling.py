"""Profiling model steps with the torch profiler: a Chrome trace with a named range per layer.

`ProfileSession` wraps a number of model steps (`EngineCore.step()` calls; the engine drives it).
While it is open, forward hooks put every layer (`layers.3`, `layers.3.attn`, `layers.3.mlp`, norms,
embeddings, head) in a `record_function` range — and an NVTX range on CUDA, for Nsight — so the
trace reads like the model. The hooks exist only while profiling: the serving path pays nothing
otherwise.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile, record_function

MAX_NAME_DEPTH = 2  # "layers.3.attn" has two dots; deeper modules (projections) show as operators


class LayerRanges:
    """Forward pre/post hooks that open and close one named range per module."""

    def __init__(self, model: nn.Module, nvtx: bool) -> None:
        self.model, self.nvtx = model, nvtx
        self._handles: list = []
        self._open: list[record_function] = []

    def named_layers(self) -> list[tuple[str, nn.Module]]:
        return [
            (name, module)
            for name, module in self.model.named_modules()
            if name
            and name.count(".") <= MAX_NAME_DEPTH
            and not isinstance(module, (nn.ModuleList, nn.ModuleDict))
        ]

    def install(self) -> None:
        for name, module in self.named_layers():
            self._handles.append(module.register_forward_pre_hook(self._enter(name)))
            self._handles.append(module.register_forward_hook(self._exit))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        while self._open:  # a forward that raised mid-way leaves ranges open
            self._close_one()

    def _enter(self, name: str):
        def hook(module, args) -> None:
            scope = record_function(name)
            scope.__enter__()
            self._open.append(scope)
            if self.nvtx:
                torch.cuda.nvtx.range_push(name)

        return hook

    def _exit(self, module, args, output) -> None:
        self._close_one()

    def _close_one(self) -> None:
        if self.nvtx:
            torch.cuda.nvtx.range_pop()
        self._open.pop().__exit__(None, None, None)


@dataclass
class OperatorStat:
    name: str
    calls: int
    self_ms: float
    total_ms: float

    def as_dict(self) -> dict:
        return {
            "name": self.name,
            "calls": self.calls,
            "self_ms": round(self.self_ms, 3),
            "total_ms": round(self.total_ms, 3),
        }


@dataclass
class ProfileResult:
    num_steps: int
    seconds: float
    trace: dict  # Chrome trace event format: open in chrome://tracing or ui.perfetto.dev
    top_operators: list[OperatorStat] = field(default_factory=list)
    table: str = ""  # the profiler's own text table of the same operators

    def summary(self) -> dict:
        return {
            "steps_profiled": self.num_steps,
            "seconds": round(self.seconds, 3),
            "top_operators": [op.as_dict() for op in self.top_operators],
        }


class ProfileSession:
    """Open with `start()`, call `step_done()` after each profiled step, `finish()` for the
    result."""

    def __init__(self, model: nn.Module, device: torch.device, top: int = 20) -> None:
        cuda = device.type == "cuda"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        self.device, self.top = device, top
        self.profiler = profile(activities=activities)
        self.ranges = LayerRanges(model, nvtx=cuda)
        self.num_steps = 0
        self._started_at = 0.0

    def start(self) -> ProfileSession:
        self.ranges.install()
        self.profiler.__enter__()
        self._started_at = time.perf_counter()
        return self

    def step_done(self) -> None:
        self.num_steps += 1

    def finish(self) -> ProfileResult:
        try:
            self.profiler.__exit__(None, None, None)
        finally:
            self.ranges.remove()
        seconds = time.perf_counter() - self._started_at
        stats, table = self._top_operators()
        return ProfileResult(self.num_steps, seconds, self._chrome_trace(), stats, table)

    def _chrome_trace(self) -> dict:
        handle, path = tempfile.mkstemp(suffix=".json", prefix="rebar-trace-")
        os.close(handle)
        try:
            self.profiler.export_chrome_trace(path)
            with open(path, encoding="utf-8") as f:
                return json.load(f)
        finally:
            os.unlink(path)

    def _top_operators(self) -> tuple[list[OperatorStat], str]:
        averages = self.profiler.key_averages()
        on_device = self.device.type == "cuda"
        sort_key = "self_device_time_total" if on_device else "self_cpu_time_total"
        rows = sorted(averages, key=lambda e: getattr(e, sort_key), reverse=True)[: self.top]
        stats = [
            OperatorStat(
                e.key,
                e.count,
                getattr(e, sort_key) / 1e3,
                (e.device_time_total if on_device else e.cpu_time_total) / 1e3,
            )
            for e in rows
        ]
        return stats, averages.table(sort_by=sort_key, row_limit=self.top)
