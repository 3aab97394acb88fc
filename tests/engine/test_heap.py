"""rebar.heap: an engine keeps its steps' freed temporaries for the next step (no page faults to
fault the same memory in again) and gives them back to the OS once it goes idle."""

from __future__ import annotations

import asyncio
import subprocess
import sys

from rebar import heap
from rebar.engine import run
from rebar.engine.async_engine import AsyncEngine
from rebar.engine.sampling_params import SamplingParams
from tiny_engine import make_core
from waiting import wait_until

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)

# Three 24 MiB temporaries, as a prefill step's are, written and freed; prints whether the heap
# served them (not a mapping each), how many MiB freeing them gave back and how many a trim then did.
TEMPORARIES = """
import sys, torch
from rebar import heap
if sys.argv[1] == "keep":
    assert heap.keep_freed_memory()
def rss_mib():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) / 1024
def in_heap(address):
    with open("/proc/self/maps") as maps:
        for line in maps:
            span, *rest = line.split()
            low, high = (int(x, 16) for x in span.split("-"))
            if low <= address < high:
                return rest[-1] == "[heap]"
    return False
blocks = [torch.empty(6 << 20) for _ in range(3)]
for block in blocks:
    block.fill_(1.0)
served_by_heap = all(in_heap(block.data_ptr()) for block in blocks)
before = rss_mib()
del blocks, block
freed = before - rss_mib()
before = rss_mib()
heap.trim()
print(served_by_heap, round(freed), round(before - rss_mib()))
"""


def temporaries(mode: str) -> tuple[bool, int, int]:
    done = subprocess.run(
        [sys.executable, "-c", TEMPORARIES, mode], capture_output=True, text=True, check=True
    )
    served_by_heap, freed, trimmed = done.stdout.split()
    return served_by_heap == "True", int(freed), int(trimmed)


def test_freed_temporaries_stay_until_a_trim() -> None:
    # By default each gets its own mapping, gone (and faulted in afresh next time) once freed.
    served_by_heap, freed, _ = temporaries("default")
    assert not served_by_heap and freed > 64
    served_by_heap, freed, trimmed = temporaries("keep")
    assert served_by_heap and freed < 8 and trimmed > 64


def test_an_engine_keeps_freed_memory_for_its_steps(tmp_path, monkeypatch) -> None:
    calls: list[bool] = []
    monkeypatch.setattr(heap, "keep_freed_memory", lambda: calls.append(True) or True)
    make_core(tmp_path)
    assert calls == [True]


def record_trims(monkeypatch, core) -> list[bool]:
    """From now on, each heap.trim call, recorded as whether `core` had nothing left to run then
    (its load has trimmed already: speculation's calibration does)."""
    calls: list[bool] = []
    monkeypatch.setattr(heap, "trim", lambda: calls.append(not core.has_unfinished_requests()))
    return calls


def test_the_offline_loop_trims_once_its_requests_are_done(tmp_path, monkeypatch) -> None:
    core = make_core(tmp_path)
    trims = record_trims(monkeypatch, core)
    admitted = [core.admit([5, 6, 7], GREEDY), core.admit([8, 9], GREEDY)]
    outputs = run.complete(core, admitted)
    assert [len(output.token_ids) for output in outputs] == [6, 6]
    assert trims == [True]  # once, after the last step, not per step


def test_the_serving_loop_trims_when_it_goes_idle_not_while_busy(tmp_path, monkeypatch) -> None:
    core = make_core(tmp_path)
    trims = record_trims(monkeypatch, core)
    engine = AsyncEngine(core)
    try:

        async def one(prompt: list[int]) -> int:
            outputs = [output async for output in engine.generate(prompt, GREEDY)]
            return sum(len(output.new_token_ids) for output in outputs)

        assert asyncio.run(one([5, 6, 7])) == 6
        wait_until(lambda: len(trims) == 1)  # the loop trims after handing the outputs on
        assert asyncio.run(one([8, 9])) == 6
        wait_until(lambda: len(trims) == 2)
    finally:
        engine.shutdown()
    assert trims == [True, True]  # six steps a request, one trim each: only on going idle
