"""Compute a prompt chunk on a thread of its own while the engine's steps go on.

A long prompt that arrives while other requests decode would otherwise either hold their steps for
a whole chunk or crawl in small chunks, each still costing a step a multiple of a decode step
(docs/benchmarks.md). On its own thread, its chunk shares the cores with the decode steps instead:
the operating system interleaves the two, each step takes a little longer, and the prompt still
moves in chunks of an efficient size.

The scheduler decides what goes here (`SchedulerOutput.background`) and keeps the chunk's request
out of every step until it lands; the chunk writes only its own request's KV blocks, which no step
reads or frees meanwhile. One chunk at a time, each on a fresh thread that ends with it, so an
engine that is dropped leaves nothing running that holds its model.

While a chunk computes, the engine's threads are split between the two (`split_threads`): the chunk
gets a team of its own and the steps run on the rest, so neither waits on the other's threads for a
core. Sharing every thread instead (the operating system interleaving the two teams) left the steps
of a small model waiting for cores at each of their many short parallel sections.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time

import torch

from rebar import openmp_team
from rebar.engine.runner import ModelRunner
from rebar.engine.scheduler import ScheduledRequest
from rebar.timing import DurationHistogram

logger = logging.getLogger("rebar.engine")

# The chunk's thread runs at this nice level above the engine's (Linux: per thread), so that the
# scheduler of the operating system gives a decode step the cores more often than the chunk: the
# stream's pace against the prompt's. Measured on two cores with both teams on every thread (before
# `split_threads`), Gemma 3 270M, one stream beside a 16,384-token prompt
# (scripts/bench_long_prompt_neighbours.py, 2026-12-06; the stream's median gap against its idle
# one, the prompt's first token): nice 0: 2.03x, 49.6 s; 2: 1.66-1.99x, 55-56 s; 3: 1.57-1.69x,
# 60 s; 4: 1.57-1.58x, 64-65 s; 6: 1.41-1.45x, 77 s (in the steps instead: ~11x, 34 s). With the
# threads split, it still ranks the engine's own Python work ahead of the chunk's.
NICENESS = 4


def split_threads(total: int, chunk_threads: int | None) -> tuple[int, int]:
    """(the chunk's threads, the steps' threads while it computes) out of the engine's `total`.

    `chunk_threads` None: half of them (at least one); as many as `total` or more: both teams use
    every thread and the operating system interleaves them. Measured on two cores against sharing
    both (scripts/bench_long_prompt_neighbours.py, docs/benchmarks.md), the stream's median gap
    against its idle one and the long prompt's first token: SmolLM2, one stream beside an
    8,000-token prompt, 2.5-3.0x and 32 s against 3.2-3.8x and 49-51 s; Gemma 3 beside 16,384
    tokens 1.75-1.90x (90th percentile 1.8-2.0x) and 38 s against 1.53-1.63x (2.4-2.5x) and
    61-63 s. The steps are slower on one thread, but never wait for a core."""
    chunk = max(1, total // 2) if chunk_threads is None else chunk_threads
    if chunk >= total:
        return total, total
    return chunk, total - chunk


class PrefillBeside:
    """Runs one prompt chunk at a time beside the caller, on `runner`; `chunk_threads` as in
    `split_threads`. The caller (the engine's thread) computes on its share of the threads from
    `start` until the chunk lands."""

    def __init__(self, runner: ModelRunner, chunk_threads: int | None = None) -> None:
        self._runner = runner
        self._chunk_threads = chunk_threads
        self._caller_threads = 0  # the caller's team before `start` cut it; 0: not cut
        self._item: ScheduledRequest | None = None
        self._thread: threading.Thread | None = None
        self._done = threading.Event()
        self._error: BaseException | None = None
        self.seconds = DurationHistogram.empty()  # each chunk, start to end

    @property
    def busy(self) -> bool:
        """Whether a chunk started and has not been collected by `landed`."""
        return self._item is not None

    def computing(self, request_id: str) -> bool:
        return self._item is not None and self._item.request_id == request_id

    def start(self, item: ScheduledRequest) -> None:
        """Compute `item` (a chunk of prompt tokens, nothing sampled after it) from now on."""
        assert self._item is None, "one chunk at a time"
        assert not item.sample and not item.draft_token_ids, item
        self._item, self._error = item, None
        self._done.clear()
        total = torch.get_num_threads()
        chunk_threads, step_threads = split_threads(total, self._chunk_threads)
        if step_threads < total and openmp_team.set_team_size(step_threads):
            self._caller_threads = total
        self._thread = threading.Thread(
            target=self._compute,
            args=(item, chunk_threads),
            name="rebar-prefill-beside",
            daemon=True,
        )
        self._thread.start()

    def _compute(self, item: ScheduledRequest, threads: int) -> None:
        started = time.monotonic()
        # Both before its first operator starts OpenMP threads, which inherit the priority.
        _lower_priority()
        openmp_team.set_team_size(threads)
        try:
            self._runner.execute([item])
        except Exception as error:  # reported to the engine when it collects the chunk
            logger.exception("prompt chunk of request %s failed", item.request_id)
            self._error = error
        finally:
            self.seconds.observe(time.monotonic() - started)
            self._done.set()

    def landed(
        self, timeout: float | None = 0.0
    ) -> tuple[ScheduledRequest, BaseException | None] | None:
        """The chunk and the error it raised (None when it computed), once it is done: waits up to
        `timeout` seconds (None: until then). None while it computes, or when none started."""
        if self._item is None or not self._done.wait(timeout):
            return None
        assert self._thread is not None
        self._thread.join()
        if self._caller_threads:
            openmp_team.set_team_size(self._caller_threads)
            self._caller_threads = 0
        item, error = self._item, self._error
        self._item = self._thread = self._error = None
        return item, error


def _lower_priority() -> None:
    """Give the calling thread `NICENESS` (where threads have priorities of their own)."""
    if sys.platform != "linux":
        return
    try:
        thread = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, thread, os.getpriority(os.PRIO_PROCESS, thread) + NICENESS)
    except OSError as error:  # a sandbox may refuse it: the chunk then runs at the same priority
        logger.debug("could not lower the prompt chunk's priority: %s", error)
