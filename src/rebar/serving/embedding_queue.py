"""Embedding work on its own thread, admitted against a bound and cancelled when its caller leaves.

Requests are cut into batches of `batch_size` texts and the worker takes one batch of each
waiting request in turn, so a 2,048-input request does not hold a one-line one for minutes. A
request whose caller left (or gave up) is dropped before its next batch, and the worker thread
never keeps the process alive at shutdown.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from rebar.serving.errors import Overloaded, ShuttingDown

logger = logging.getLogger("rebar.serving")

EmbedInput = str | Sequence[int]  # a text, or token ids read as given
EmbedBatch = Callable[[list[EmbedInput]], Sequence[np.ndarray]]  # one vector per input


@dataclass
class _Job:
    texts: list[EmbedInput]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    vectors: list[np.ndarray] = field(default_factory=list)
    cancelled: threading.Event = field(default_factory=threading.Event)


_STOP = object()


class EmbeddingQueue:
    """Runs `embed_batch` for admitted requests, one batch at a time, round robin.

    Callers may rely on: `embed` raising Overloaded (with a retry delay) when the texts would push
    the waiting inputs past `max_waiting_inputs`; a cancelled `embed` (client gone, timeout)
    costing at most the batch in progress; `num_waiting_inputs` returning to 0 when idle.
    """

    def __init__(
        self,
        embed_batch: EmbedBatch,
        max_waiting_inputs: int,
        retry_after_s: int,
        batch_size: int = 32,
    ) -> None:
        self.embed_batch, self.batch_size = embed_batch, batch_size
        self.max_waiting_inputs, self.retry_after_s = max_waiting_inputs, retry_after_s
        self.num_waiting_inputs = 0
        self.num_rejected = 0
        self._inbox: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None

    async def embed(self, texts: list[EmbedInput]) -> list[np.ndarray]:
        if self.num_waiting_inputs + len(texts) > self.max_waiting_inputs:
            self.num_rejected += 1
            raise Overloaded(
                "the server is at capacity for embeddings; retry later", self.retry_after_s
            )
        self._start()
        loop = asyncio.get_running_loop()
        job = _Job(list(texts), loop, loop.create_future())
        self.num_waiting_inputs += len(texts)
        self._inbox.put(job)
        try:
            return await job.future
        finally:
            # a no-op once done; otherwise the worker drops it before its next batch
            job.cancelled.set()
            self.num_waiting_inputs -= len(texts)

    def shutdown(self, timeout: float = 5.0) -> None:
        if self._thread is not None:
            self._inbox.put(_STOP)
            self._thread.join(timeout)
            self._thread = None

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="rebar-embeddings", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        active: deque[_Job] = deque()
        while True:
            try:
                item = self._inbox.get(block=not active)
            except queue.Empty:
                item = None
            if item is _STOP:
                for job in active:
                    _settle(job, ShuttingDown("the model is shutting down"))
                return
            if item is not None:
                active.append(item)
                # take everything queued before the next batch, so new requests join the rotation
                continue
            job = active.popleft()
            if job.cancelled.is_set():
                continue
            done = len(job.vectors)
            try:
                job.vectors.extend(self.embed_batch(job.texts[done : done + self.batch_size]))
            except Exception as exc:
                logger.exception("embedding batch failed")
                _settle(job, exc)
                continue
            if len(job.vectors) == len(job.texts):
                _settle(job, job.vectors)
            else:
                active.append(job)


def _settle(job: _Job, result: list[np.ndarray] | BaseException) -> None:
    def settle() -> None:
        if job.future.done():
            return
        if isinstance(result, BaseException):
            job.future.set_exception(result)
        else:
            job.future.set_result(result)

    try:
        job.loop.call_soon_threadsafe(settle)
    except RuntimeError:  # the caller's loop is closed
        pass
