"""One loaded version of a served model, typed by what it does, and the leases requests hold on it.

A request takes a `Lease` on the version it starts on and keeps it until its response has been
sent, so a reload can switch new requests to a new version while the old one finishes what it
started and is freed only when its last lease ends.
"""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from rebar import heap
from rebar.config import ServedModelSettings
from rebar.engine.async_engine import EngineFront
from rebar.engine.embedder import Embedder
from rebar.engine.model_text import ModelText
from rebar.serving.embedding_queue import EmbeddingQueue

logger = logging.getLogger("rebar.serving")
V = TypeVar("V", bound="ModelVersion")


@dataclass(eq=False)
class ModelVersion:
    """What every loaded version has: its entry, version number and path, its text side (tokenizer,
    template, context window), and what it holds (weights + KV cache, measured after the load)."""

    entry: ServedModelSettings
    version: int
    path: str
    text: ModelText
    footprint_bytes: int
    load_seconds: float
    num_leases: int = 0
    closed: bool = False
    _idle: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self._idle.set()

    @property
    def label(self) -> str:
        """What responses name as the version that produced them, e.g. `smollm2-v3`."""
        return f"{self.entry.name}-v{self.version}"

    def lease(self, on_release: Callable[[], None] | None = None) -> Lease[ModelVersion]:
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

    def close(self, free_memory: bool = True) -> None:
        """Stop its engine or embedding thread and drop the weights (blocking: run it off the
        event loop). Requests still running end with the engine's shutdown reason.

        `free_memory` gives the weights' pages back at once (an unload: the process serves on).
        At shutdown nothing needs them back, and the full collection that takes costs ~0.2 s
        per model."""
        if self.closed:
            return
        self.closed = True
        self._stop()
        if free_memory:
            # Nothing here may keep the tensors alive: the caller drops the version, and a
            # collection frees weights held in reference cycles now rather than at some later
            # allocation.
            gc.collect()
            heap.trim()  # or glibc keeps the freed weights' pages resident

    def _stop(self) -> None:
        raise NotImplementedError


@dataclass(eq=False)
class ChatModel(ModelVersion):
    """A chat model: requests run on its engine (a thread of this process, or a process of its
    own)."""

    engine: EngineFront | None = None  # set at construction; None only once closed

    def _stop(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
        self.engine = None
        self.text = None  # type: ignore[assignment]

    @property
    def front(self) -> EngineFront:
        assert self.engine is not None, "a leased chat model is open"
        return self.engine


@dataclass(eq=False)
class EmbeddingModel(ModelVersion):
    """An embedding model: its texts are embedded by a queue of its own, one batch at a time."""

    embedder: Embedder | None = None
    queue: EmbeddingQueue | None = None

    def _stop(self) -> None:
        if self.queue is not None:
            self.queue.shutdown()
        self.embedder = self.queue = None
        self.text = None  # type: ignore[assignment]

    @property
    def dimensions(self) -> int:
        assert self.embedder is not None, "a leased embedding model is open"
        return self.embedder.dimensions

    @property
    def max_input_tokens(self) -> int:
        """The longest input the model reads whole, in tokens."""
        assert self.embedder is not None, "a leased embedding model is open"
        return self.embedder.max_input_tokens

    @property
    def vocab_size(self) -> int:
        assert self.embedder is not None, "a leased embedding model is open"
        return self.embedder.vocab_size

    @property
    def embeddings(self) -> EmbeddingQueue:
        assert self.queue is not None, "a leased embedding model is open"
        return self.queue


class Lease(Generic[V]):
    """A request's hold on one version; `release` is idempotent."""

    def __init__(self, version: V, on_release: Callable[[], None] | None = None) -> None:
        self.version = version
        self._on_release = on_release
        self.released = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.version._released()
            if self._on_release is not None:
                self._on_release()


async def wait_set(event: asyncio.Event, timeout_s: float) -> bool:
    """True once `event` is set; False if `timeout_s` passed first."""
    try:
        await asyncio.wait_for(event.wait(), timeout_s)
    except TimeoutError:
        return False
    return True
