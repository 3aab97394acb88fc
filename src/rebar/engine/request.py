"""One generation request's state as the scheduler and engine core see it (plain Python, no
torch)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from rebar.engine.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    """Lifecycle of a request. Finished states sort after every live one: `status.is_finished`."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2  # blocks taken back; waits to recompute its tokens
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_TIMEOUT = 6
    FINISHED_ERROR = 7

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_TIMEOUT: "timeout",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(frozen=True)
class AdmittedRequest:
    """A prompt and its params that `EngineCore.admit` checked, with the length they may reach.

    Callers may rely on: `prompt_token_ids` are integers in the vocabulary, leaving room to
    generate; `params` name only tokens of the vocabulary; `max_total_tokens` fits the context
    window. Only `admit` makes one; the core that made it queues it without checking it again.
    """

    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    max_total_tokens: int  # prompt + outputs never exceed this (max_tokens or the context window)
    issuer: object = field(repr=False, compare=False)  # the admitting core's key

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(eq=False)
class Request:
    """Tokens known so far (`token_ids` = prompt + outputs) and how many of them have KV in the
    cache.

    The scheduler's one invariant: `num_computed_tokens <= num_tokens`; a step computes tokens
    `[num_computed_tokens, num_computed_tokens + n)` and, when that reaches `num_tokens`, samples
    one more.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_total_tokens: int  # prompt + outputs never exceed this (max_tokens or the context window)
    arrival_time: float = field(default_factory=time.monotonic)
    scheduled_time: float | None = None  # first time the scheduler gave it compute
    first_token_time: float | None = None
    finished_time: float | None = None
    deadline: float | None = None  # time.monotonic() after which the request times out
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache on first schedule
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: str | int | None = None
    error: str | None = None
    cache_salt: str | None = (
        None  # prefix-cache blocks are shared only between requests with equal salts
    )
    block_hashes: list[bytes] = field(
        default_factory=list
    )  # chained hashes of its full blocks, filled lazily
    # The engine core's companions (its EngineSideState: sampler RNG, detokenizer, pending
    # logprobs), opaque here so the scheduler's side never depends on the core's tensor-side types;
    # None only for requests the scheduler's own tests build.
    state: object = None

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    def append_output(self, token_id: int) -> None:
        self.token_ids.append(token_id)
