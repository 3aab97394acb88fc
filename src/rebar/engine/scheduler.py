"""Continuous batching: decide, every step, which tokens of which requests the model computes.

One mechanism covers prefill, chunked prefill, prefix-cache hits, decode and recompute after
preemption: each request's `num_computed_tokens` catches up with its `num_tokens` under a per-step
token budget. Running requests go first (oldest first), then waiting ones in arrival order. When
the KV pool runs dry, the newest running request is preempted (its blocks freed, to be recomputed
later), so the oldest always make progress and nothing starves.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from rebar.engine.engine_config import EngineConfig
from rebar.engine.kv_cache_manager import KVCacheManager
from rebar.engine.request import Request, RequestStatus


@dataclass(frozen=True)
class SchedulerConfig:
    """The step limits: requests in one step, and tokens in one step (longer prefills are split).

    Both are the engine settings of the same names.
    """

    max_num_seqs: int
    max_num_batched_tokens: int

    def __post_init__(self) -> None:
        assert self.max_num_seqs >= 1 and self.max_num_batched_tokens >= 1, self

    @classmethod
    def of(cls, config: EngineConfig) -> SchedulerConfig:
        return cls(config.max_num_seqs, config.max_num_batched_tokens)


@dataclass(frozen=True)
class ScheduledRequest:
    """Compute `token_ids` at positions `start_position...`; sample a token after the last one if
    `sample`."""

    request_id: str
    token_ids: tuple[int, ...]
    start_position: int
    block_ids: tuple[int, ...]
    sample: bool


@dataclass(frozen=True)
class SchedulerOutput:
    """One step's plan: what the model computes, in order. Preemptions show on the requests."""

    scheduled: tuple[ScheduledRequest, ...]

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_manager: KVCacheManager) -> None:
        self.config = config
        self.kv = kv_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    # ----- queue management ----------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        assert request.request_id not in self.requests, f"duplicate request id {request.request_id}"
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_request(
        self, request_id: str, status: RequestStatus, keep_cached: bool = True
    ) -> Request | None:
        """The single exit: stop, length, abort, timeout and error all come here and free the
        blocks."""
        assert status.is_finished
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        request.status = status
        self.kv.free(request, keep_cached=keep_cached)
        return request

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    # ----- one step --------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[str] = []

        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self._allocate_or_preempt(request, num_new, preempted):
                break  # the request itself was preempted: everything after it is gone too
            scheduled.append(self._scheduled(request, num_new))
            budget -= num_new
            index += 1

        # Admit waiting requests only when nothing had to be preempted this step.
        while (
            self.waiting
            and not preempted
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
        ):
            request = self.waiting[0]
            cached = self.kv.find_cached_prefix(request)
            num_cached_tokens = len(cached) * self.kv.block_size
            num_new = min(request.num_tokens - num_cached_tokens, budget)
            if not self.kv.allocate(request, num_new, cached):
                break  # FCFS: the head waits for blocks; later requests do not jump it
            self.waiting.popleft()
            if request.status == RequestStatus.WAITING:
                request.num_cached_tokens = num_cached_tokens
            request.num_computed_tokens = num_cached_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append(self._scheduled(request, num_new))
            budget -= num_new
        return SchedulerOutput(tuple(scheduled))

    def _allocate_or_preempt(self, request: Request, num_new: int, preempted: list[str]) -> bool:
        while not self.kv.allocate(request, num_new):
            victim = self.running.pop()  # the newest running request
            self._preempt(victim)
            preempted.append(victim.request_id)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _scheduled(self, request: Request, num_new: int) -> ScheduledRequest:
        start = request.num_computed_tokens
        end = start + num_new
        return ScheduledRequest(
            request_id=request.request_id,
            token_ids=tuple(request.token_ids[start:end]),
            start_position=start,
            block_ids=tuple(self.kv.block_ids(request.request_id)),
            sample=end == request.num_tokens,
        )

    def update_after_step(self, output: SchedulerOutput) -> None:
        """The model computed every scheduled token: advance `num_computed_tokens`."""
        for item in output.scheduled:
            request = self.requests.get(item.request_id)
            if request is not None:
                request.num_computed_tokens = item.start_position + len(item.token_ids)

    def check_integrity(self) -> None:
        assert set(self.requests) == {r.request_id for r in self.running} | {
            r.request_id for r in self.waiting
        }
        assert all(r.status == RequestStatus.RUNNING for r in self.running)
        assert all(
            r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED) for r in self.waiting
        )
        assert all(not self.kv.block_ids(r.request_id) for r in self.waiting)
        assert len(self.running) <= self.config.max_num_seqs
        self.kv.check_integrity()
