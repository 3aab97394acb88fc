"""One loaded version of a served model, and the leases requests hold on it.

A request takes a `Lease` on the instance it starts on and keeps it until its response has been
sent, so a reload can switch new requests to a new version while the old one finishes what it
started and is freed only when its last lease ends.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import weakref
from collections.abc import AsyncIterable, AsyncIterator, Callable
from dataclasses import dataclass, field

from fastapi.responses import Response, StreamingResponse

from rebar import heap
from rebar.config import ServedModelSettings
from rebar.engine.async_engine import EngineFront
from rebar.engine.llm import LLM
from rebar.engine.model_text import ModelText
from rebar.server.embedding_queue import EmbeddingQueue

logger = logging.getLogger("rebar.server")


@dataclass(eq=False)
class ModelInstance:
    """A model's weights and engine (chat) or embedder (embedding) as one version loaded them.

    `footprint_bytes` is what it holds (weights + KV cache), measured after the load.
    """

    entry: ServedModelSettings
    version: int
    path: str
    text: ModelText  # chat: the LLM, or only its text side when the engine runs in a process
    footprint_bytes: int
    load_seconds: float
    engine: EngineFront | None = None  # chat models
    embedder: LLM | None = None  # embedding models
    embedding_queue: EmbeddingQueue | None = None  # embedding models
    num_leases: int = 0
    closed: bool = False
    _idle: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self._idle.set()

    @property
    def label(self) -> str:
        """What responses name as the version that produced them, e.g. `smollm2-v3`."""
        return f"{self.entry.name}-v{self.version}"

    def lease(self, on_release: Callable[[], None] | None = None) -> Lease:
        self.num_leases += 1
        self._idle.clear()
        return Lease(self, on_release)

    def _released(self) -> None:
        self.num_leases -= 1
        if self.num_leases == 0:
            self._idle.set()

    async def wait_idle(self, timeout_s: float) -> bool:
        """True once no lease is held; False if `timeout_s` passed first."""
        return await wait_set(self._idle, timeout_s)

    def close(self) -> None:
        """Stop its engine or embedding thread and drop the weights (blocking: run it off the
        event loop). Requests still running end with the engine's shutdown reason."""
        if self.closed:
            return
        self.closed = True
        if self.engine is not None:
            self.engine.shutdown()
        if self.embedding_queue is not None:
            self.embedding_queue.shutdown()
        # Nothing here may keep the tensors alive: the caller drops the instance, and a collection
        # frees weights held in reference cycles now rather than at some later allocation.
        self.engine = self.embedder = self.embedding_queue = None
        self.text = None  # type: ignore[assignment]
        gc.collect()
        heap.trim()  # or glibc keeps the freed weights' pages resident


class Lease:
    """A request's hold on one instance; `release` is idempotent."""

    def __init__(
        self, instance: ModelInstance, on_release: Callable[[], None] | None = None
    ) -> None:
        self.instance = instance
        self._on_release = on_release
        self.released = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.instance._released()
            if self._on_release is not None:
                self._on_release()

    def hold_until_sent(self, response: Response) -> Response:
        """Release when `response` has been sent: at once for a plain body, after the last chunk
        (or the client leaving) for a stream."""
        if isinstance(response, StreamingResponse):
            response.body_iterator = self._released_after(response.body_iterator)
            # A stream whose body never starts (the client left first) never runs the wrapper's
            # `finally`; dropping the response then releases the lease.
            loop = asyncio.get_running_loop()
            weakref.finalize(response, _call_soon, loop, self.release)
        else:
            self.release()
        return response

    async def _released_after(self, body: AsyncIterable) -> AsyncIterator:
        try:
            async for chunk in body:
                yield chunk
        finally:
            self.release()


def _call_soon(loop: asyncio.AbstractEventLoop, callback) -> None:
    if not loop.is_closed():
        loop.call_soon_threadsafe(callback)


async def wait_set(event: asyncio.Event, timeout_s: float) -> bool:
    """True once `event` is set; False if `timeout_s` passed first."""
    try:
        await asyncio.wait_for(event.wait(), timeout_s)
    except TimeoutError:
        return False
    return True
