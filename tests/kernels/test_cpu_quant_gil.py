"""The C++ kernels compute without holding Python's GIL: while one thread runs a long quantized
matmul, the others run Python (the server's event loop, the engine's steps beside a prompt chunk)."""

from __future__ import annotations

import threading
import time

import torch
from cpu_quant_helpers import random_activations, random_int4, require_kernels

from rebar import openmp_team
from rebar.kernels import cpu_quant


def test_python_runs_on_while_a_kernel_computes() -> None:
    require_kernels()
    gen = torch.Generator().manual_seed(0)
    weight = random_int4(4096, 2048, 32, torch.float16, gen)
    packed = cpu_quant.pack_int4(weight.qweight, weight.scales, weight.offsets, 32)
    x = random_activations(1024, 2048, gen)  # ~0.1 s a call on one core here
    started, done = threading.Event(), threading.Event()
    call: list[float] = []

    def compute() -> None:
        openmp_team.set_team_size(1)  # one core computes, the other runs the loop below
        started.set()
        begin = time.perf_counter()
        for _ in range(4):  # one call, repeated: its duration is this test's own calibration
            cpu_quant.linear_packed(x, packed)
        call.append((time.perf_counter() - begin) / 4)
        done.set()

    worker = threading.Thread(target=compute)
    worker.start()
    assert started.wait(30)
    gaps, last = [], time.perf_counter()
    while not done.is_set():
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
    worker.join()
    # Holding the GIL, each call would stop this loop for its whole duration; without it, the loop
    # waits only for the moments the worker runs Python between calls (up to the interpreter's 5 ms
    # switch interval) and the system's time slices.
    assert max(gaps) < call[0] / 3, (max(gaps), call[0])
