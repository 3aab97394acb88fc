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
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time

from rebar.engine.runner import ModelRunner
from rebar.engine.scheduler import ScheduledRequest
from rebar.timing import DurationHistogram

logger = logging.getLogger("rebar.engine")

# The chunk's thread runs at this nice level above the engine's (Linux: per thread), so that the
# scheduler of the operating system gives a decode step the cores more often than the chunk: the
# stream's pace against the prompt's. Measured on two cores, Gemma 3 270M, one stream beside a
# 16,384-token prompt (scripts/bench_long_prompt_neighbours.py, 2026-12-06; the stream's median gap
# against its idle one, the prompt's first token): nice 0: 2.03x, 49.6 s; 2: 1.66-1.99x, 55-56 s;
# 3: 1.57-1.69x, 60 s; 4: 1.57-1.58x, 64-65 s; 6: 1.41-1.45x, 77 s (in the steps instead: ~11x,
# 34 s).
NICENESS = 4


class PrefillBeside:
    """Runs one prompt chunk at a time beside the caller, on `runner`."""

    def __init__(self, runner: ModelRunner) -> None:
        self._runner = runner
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
        self._thread = threading.Thread(
            target=self._compute, args=(item,), name="rebar-prefill-beside", daemon=True
        )
        self._thread.start()

    def _compute(self, item: ScheduledRequest) -> None:
        started = time.monotonic()
        _lower_priority()  # before its first operator starts OpenMP threads, which inherit it
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
