"""A calibration for the few tests where time is the point (tests/waiting.py covers the rest).

`reference_s()` times a fixed piece of pure-Python work (building and reading a dictionary of
string keys, as loading a vocabulary does) on this machine, now: a test that must show something is
fast compares its elapsed time with a generous multiple of it, measured in the same test, so a
machine that is slower or busier moves the bound with the figure. Median of a few runs.
"""

from __future__ import annotations

import statistics
import time


def _work() -> int:
    table = {f"token-{i}": i for i in range(100_000)}
    return sum(table[f"token-{i}"] for i in range(0, 100_000, 7))


def reference_s(repeats: int = 5) -> float:
    """Median seconds of the reference work, on this machine as it is now."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        _work()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def elapsed_s(call) -> tuple[object, float]:
    """(call(), the seconds it took)."""
    started = time.perf_counter()
    result = call()
    return result, time.perf_counter() - started
