"""EmbeddingQueue: admission, round-robin batches, cancellation, failures and shutdown, on a fake
model."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from rebar.server.errors import problem_of
from rebar.serving.embedding_queue import EmbeddingQueue
from rebar.serving.errors import Overloaded, ShuttingDown


class FakeModel:
    """Embeds a text as [len(text)]; records every batch; can be slowed, gated or made to fail."""

    def __init__(self, delay_s: float = 0.0, fail_on: str | None = None) -> None:
        self.batches: list[list[str]] = []
        self.delay_s, self.fail_on = delay_s, fail_on
        self.lock = threading.Lock()

    def __call__(self, texts: list[str]) -> list[np.ndarray]:
        with self.lock:
            self.batches.append(list(texts))
        time.sleep(self.delay_s)
        if self.fail_on in texts:
            raise RuntimeError("boom")
        return [np.array([len(t)], dtype=np.float32) for t in texts]


@pytest.fixture
def make_queue() -> Iterator:
    """Builds EmbeddingQueues (retry_after_s 1 unless given) and shuts each down after the test."""
    made: list[EmbeddingQueue] = []

    def make(
        model, max_waiting_inputs: int, batch_size: int = 32, retry_after_s: int = 1
    ) -> EmbeddingQueue:
        made.append(EmbeddingQueue(model, max_waiting_inputs, retry_after_s, batch_size))
        return made[-1]

    yield make
    for queue in made:
        queue.shutdown()


def test_vectors_come_back_in_order_in_batches(make_queue) -> None:
    model = FakeModel()
    queue = make_queue(model, 100, batch_size=4)

    async def main():
        return await queue.embed(["a" * n for n in range(1, 11)])

    vectors = asyncio.run(main())
    assert [int(v[0]) for v in vectors] == list(range(1, 11))
    assert [len(b) for b in model.batches] == [4, 4, 2]
    assert queue.num_waiting_inputs == 0


def test_admission_refuses_past_the_bound_with_503(make_queue) -> None:
    model = FakeModel(delay_s=0.05)
    queue = make_queue(model, 8, batch_size=4, retry_after_s=3)

    async def main():
        first = asyncio.ensure_future(queue.embed(["x"] * 8))
        await asyncio.sleep(0)
        with pytest.raises(Overloaded) as refused:
            await queue.embed(["y"])
        problem = problem_of(refused.value)
        assert problem.status == 503 and problem.headers == {"Retry-After": "3"}
        assert len(await first) == 8
        assert len(await queue.embed(["z"])) == 1  # room again once the first is done

    asyncio.run(main())
    assert queue.num_rejected == 1 and queue.num_waiting_inputs == 0


def test_a_small_request_is_not_stuck_behind_a_large_one(make_queue) -> None:
    model = FakeModel(delay_s=0.01)
    queue = make_queue(model, 1000, batch_size=4)

    async def main():
        large = asyncio.ensure_future(queue.embed(["L"] * 200))
        while not model.batches:  # the large request is in work
            await asyncio.sleep(0.001)
        submitted_at.append(len(model.batches))
        await queue.embed(["small"])
        assert not large.done()  # the one-text request finished while 200 texts were still in work
        await large

    submitted_at: list[int] = []
    asyncio.run(main())
    # A count, not a clock: the small text ran within a batch or two of arriving.
    small_at = next(i for i, b in enumerate(model.batches) if b == ["small"])
    assert small_at <= submitted_at[0] + 2, (small_at, submitted_at)


def test_a_cancelled_request_stops_after_the_batch_in_progress(make_queue) -> None:
    model = FakeModel(delay_s=0.02)
    queue = make_queue(model, 4096, batch_size=32)

    async def main():
        job = asyncio.ensure_future(queue.embed(["t"] * 2048))
        await asyncio.sleep(0.1)
        job.cancel()
        await asyncio.gather(job, return_exceptions=True)
        assert queue.num_waiting_inputs == 0
        batches_at_cancel = len(model.batches)
        await asyncio.sleep(0.2)
        return batches_at_cancel

    at_cancel = asyncio.run(main())
    assert len(model.batches) <= at_cancel + 1  # at most the batch that was running
    assert len(model.batches) < 2048 // 32


def test_one_failing_request_fails_alone(make_queue) -> None:
    model = FakeModel(fail_on="bad")
    queue = make_queue(model, 100)

    async def main():
        bad = asyncio.ensure_future(queue.embed(["bad"]))
        good = asyncio.ensure_future(queue.embed(["good"]))
        results = await asyncio.gather(bad, good, return_exceptions=True)
        assert isinstance(results[0], RuntimeError)
        assert int(results[1][0][0]) == 4

    asyncio.run(main())


def test_shutdown_fails_waiting_requests_and_the_thread_never_blocks_exit(make_queue) -> None:
    gate = threading.Event()
    queue = make_queue(
        lambda texts: (gate.wait(5), [np.zeros(1)] * len(texts))[1], 100, batch_size=1
    )

    async def main():
        job = asyncio.ensure_future(queue.embed(["a", "b", "c"]))
        await asyncio.sleep(0.05)
        stopper = asyncio.get_running_loop().run_in_executor(None, queue.shutdown, 5.0)
        gate.set()
        await stopper
        with pytest.raises(ShuttingDown) as stopped:
            await job
        assert problem_of(stopped.value).status == 503

    asyncio.run(main())
    # The worker is gone (and, being a daemon, could never have held the process open at exit).
    assert not any(t.name == "rebar-embeddings" and t.is_alive() for t in threading.enumerate())
