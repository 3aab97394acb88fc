"""Continuous batching: decide, every step, which tokens of which requests the model computes.

One mechanism covers prefill, chunked prefill, prefix-cache hits, decode and recompute after
preemption: each request's `num_computed_tokens` catches up with its `num_tokens` under a per-step
token budget. A decoding request may also get lookahead slots for draft tokens (speculative
decoding): granted after every running and admitted request has its share, from the budget and
free blocks left over, so a guess never preempts or delays anyone; whatever the drafts do not keep
is given back after the step (`commit_drafts`).

While requests are decoding, and no fewer of them than requests with a prompt to prefill, prompt
tokens (prefill, chunked or not) take at most `max_prefill_tokens_while_decoding` of a step: a long
prompt then delays the others' next tokens by a short step at a time, not by a whole budget-sized
chunk each; a burst of prompts (more of them than streams decoding) prefills at full speed.
Measured on two cores, Gemma 3 270M, one stream decoding while a 16,384-token prompt arrives: its
inter-token time 5.0 s (median) with 2,048-token chunks, 0.51 s at 256 and 0.18 s at 64 (idle: ~10
ms); the prompt's own time to first token 40.7 s, 33.6 s and 43.0 s. Sixteen 2,048-token SmolLM2
prompts at once were all done in 66 s with the cap whenever anything decoded, 53-55 s with this
rule, 48-50 s with no cap (docs/benchmarks.md).

With `background` (the engine's `prefill_beside_decode`), such a capped prompt longer than the cap
computes instead on a thread of its own beside the steps, one chunk at a time (`in_flight`, up to
`max_num_batched_tokens` tokens), all but its last token, which a step computes and samples after
as usual: the decoding requests' steps then share the cores with the prompt rather than wait for its
chunks. Other long prompts wait for the thread meanwhile, capped or not (in the steps they would
slow every decoding request twice over: the step's prompt work and the thread's share the cores).
A request in flight is not scheduled, preempted or freed until its chunk lands (`land`), and its
chunk's blocks are published in the prefix cache only then.

Running requests go first (oldest first), then waiting ones in arrival order. When
the KV pool runs dry, the newest running request is preempted (its blocks freed, to be recomputed
later), so the oldest always make progress and nothing starves.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from rebar.engine.engine_config import EngineConfig
from rebar.engine.kv_cache_manager import KVCacheManager, blocks_needed
from rebar.engine.request import Request, RequestStatus


@dataclass(frozen=True)
class SchedulerConfig:
    """The step limits: requests in one step, tokens in one step (longer prefills are split), and
    prompt tokens in a step that also decodes (None: no limit but the step's).

    All are the engine settings of the same names.
    """

    max_num_seqs: int
    max_num_batched_tokens: int
    max_prefill_tokens_while_decoding: int | None = None

    def __post_init__(self) -> None:
        assert self.max_num_seqs >= 1 and self.max_num_batched_tokens >= 1, self
        cap = self.max_prefill_tokens_while_decoding
        assert cap is None or cap >= 1, self

    @classmethod
    def of(cls, config: EngineConfig) -> SchedulerConfig:
        return cls(
            config.max_num_seqs,
            config.max_num_batched_tokens,
            config.max_prefill_tokens_while_decoding,
        )


@dataclass(frozen=True)
class ScheduledRequest:
    """Compute `token_ids` at positions `start_position...`; sample a token after the last one if
    `sample`.

    `num_lookahead` slots after them hold blocks for draft tokens; the engine fills
    `draft_token_ids` (at most that many) before the model runs, and then every draft token is
    computed too and sampled after, each as its own one-token row.

    `prompt`: the tokens are the prompt's, computed as the whole prompt would compute them (a
    single one too: never as a decode row), so a prompt's numbers do not depend on how it was cut
    into chunks or how much of it a prefix-cache hit supplied.
    """

    request_id: str
    token_ids: tuple[int, ...]
    start_position: int
    block_ids: tuple[int, ...]
    sample: bool
    num_lookahead: int = 0
    draft_token_ids: tuple[int, ...] = ()
    prompt: bool = False

    @property
    def num_rows(self) -> int:
        """Tokens the model computes for this item: its own and its drafts."""
        return len(self.token_ids) + len(self.draft_token_ids)


@dataclass
class _Plan:
    """A step's plan while `Scheduler.schedule` builds it: what is left of its budgets, and
    whether a chunk may start beside the steps (`background`, when the prompt cap applies:
    `capped`) and which chunk started this step."""

    budget: int
    prompt_budget: int
    background: bool
    capped: bool
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    started: ScheduledRequest | None = None

    def take(self, item: ScheduledRequest, prompt: bool) -> None:
        self.scheduled.append(item)
        self.budget -= len(item.token_ids)
        if prompt:
            self.prompt_budget -= len(item.token_ids)


@dataclass(frozen=True)
class SchedulerOutput:
    """One step's plan: what the model computes, in order. Preemptions show on the requests."""

    scheduled: tuple[ScheduledRequest, ...]
    # A prompt chunk to compute beside this step and the next ones, until it lands (`land`).
    background: ScheduledRequest | None = None

    @property
    def is_empty(self) -> bool:
        """Nothing for this step's model pass (a chunk may still start beside it)."""
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_manager: KVCacheManager) -> None:
        self.config = config
        self.kv = kv_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.in_flight: ScheduledRequest | None = None  # the prompt chunk computing beside steps
        # The in-flight chunk's request when it finished before the chunk landed, and whether its
        # published blocks stay cached: its blocks are freed when the chunk lands.
        self._finished_in_flight: tuple[Request, bool] | None = None

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
        if self._is_in_flight(request):  # its chunk still writes its blocks: freed when it lands
            self._finished_in_flight = (request, keep_cached)
        else:
            self.kv.free(request, keep_cached=keep_cached)
        return request

    def land(self, failed: bool = False) -> Request | None:
        """The chunk in flight is computed (or, `failed`, it raised): its request counts its tokens
        as computed and publishes their blocks. Returns the request if still live (the caller fails
        it when `failed`), None when it finished meanwhile (its blocks are freed now)."""
        item = self.in_flight
        assert item is not None, "no prompt chunk in flight"
        self.in_flight = None
        if self._finished_in_flight is not None:
            request, keep_cached = self._finished_in_flight
            self._finished_in_flight = None
            self.kv.free(request, keep_cached=keep_cached and not failed)
            return None
        request = self.requests[item.request_id]
        if not failed:
            request.num_computed_tokens = item.start_position + len(item.token_ids)
            self.kv.publish(request, request.num_computed_tokens)
        return request

    def _is_in_flight(self, request: Request) -> bool:
        return self.in_flight is not None and self.in_flight.request_id == request.request_id

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    # ----- one step --------------------------------------------------------------------------
    def schedule(
        self, lookahead: Mapping[str, int] | None = None, background: bool = False
    ) -> SchedulerOutput:
        """This step's plan. `lookahead` asks, by request id, for draft slots after a decoding
        request's next token: granted last, from the budget and free blocks every running and
        admitted request left over (fewer or none when short), so drafts never displace anyone.
        `background`: a prompt chunk may start beside the step (see the module's docstring); while
        one is in flight, long prompts wait for it whatever `background` says."""
        capped = self._prompts_capped()
        plan = _Plan(
            self.config.max_num_batched_tokens,
            self._prompt_budget(capped),
            background=background,
            capped=capped,
        )
        self._schedule_running(plan)
        if not plan.preempted:  # admit waiting requests only when nobody had to give way
            self._admit_waiting(plan)
        scheduled = plan.scheduled
        if lookahead:
            scheduled = self._with_lookahead(scheduled, lookahead, plan.budget)
        return SchedulerOutput(tuple(scheduled), plan.started)

    def _schedule_running(self, plan: _Plan) -> None:
        """The running requests' shares of the step, oldest first, preempting the newest when the
        pool runs dry."""
        index = 0
        while index < len(self.running) and plan.budget > 0:
            request = self.running[index]
            index += 1
            if self._is_in_flight(request):
                continue  # its chunk computes beside this step
            if self._beside_length(request.num_tokens - request.num_computed_tokens):
                if self.in_flight is not None:
                    continue  # a long prompt waits for the thread, not to slow the steps
                if plan.background and plan.capped and self._start_beside(request):
                    plan.started = self.in_flight
                    continue
                # No chunk may start, or too few free blocks for a whole one: a share of the
                # step, as without.
            num_new = _share(request, plan.budget, plan.prompt_budget)
            if num_new == 0:
                continue  # a prompt past this step's prompt budget: its turn comes later
            if not self._allocate_or_preempt(request, num_new, plan.preempted):
                return  # the request itself was preempted: everything after it is gone too
            plan.take(self._scheduled(request, num_new), _is_prompt(request))

    def _admit_waiting(self, plan: _Plan) -> None:
        """Waiting requests in arrival order, while the step's budgets, the sequence limit and the
        pool have room (a prefix-cache hit counts as computed)."""
        while (
            self.waiting
            and plan.budget > 0
            and plan.prompt_budget > 0
            and len(self.running) < self.config.max_num_seqs
        ):
            request = self.waiting[0]
            cached = self.kv.find_cached_prefix(request)
            num_cached_tokens = len(cached) * self.kv.block_size
            num_left = request.num_tokens - num_cached_tokens
            beside = self._beside_length(num_left)
            if beside and self.in_flight is not None:
                return  # the head waits for the thread; later requests do not jump it
            beside = beside if plan.background and plan.capped else 0
            num_new = beside or min(num_left, plan.budget, plan.prompt_budget)
            if not self.kv.allocate(request, num_new, cached, publish=not beside):
                return  # FCFS: the head waits for blocks; later requests do not jump it
            self.waiting.popleft()
            if request.status == RequestStatus.WAITING:
                request.num_cached_tokens = num_cached_tokens
            request.num_computed_tokens = num_cached_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            if beside:
                plan.started = self.in_flight = self._scheduled(request, num_new)
            else:
                plan.take(self._scheduled(request, num_new), prompt=True)

    def _beside_length(self, num_left: int) -> int:
        """Tokens of a prompt with `num_left` to compute that a chunk beside the steps takes: all
        but the last (a step samples after it), at most a step's budget; 0 when what a step takes
        of a prompt while others decode would cover them anyway."""
        limit = self.config.max_prefill_tokens_while_decoding
        if limit is None or num_left - 1 <= limit:
            return 0
        return min(num_left - 1, self.config.max_num_batched_tokens)

    def _start_beside(self, request: Request) -> bool:
        """Put the next chunk of a running prompt in flight, if long enough and its blocks are free
        (nobody is preempted for it)."""
        length = self._beside_length(request.num_tokens - request.num_computed_tokens)
        if not length or not self.kv.allocate(request, length, publish=False):
            return False
        self.in_flight = self._scheduled(request, length)
        return True

    def _with_lookahead(
        self, scheduled: list[ScheduledRequest], lookahead: Mapping[str, int], budget: int
    ) -> list[ScheduledRequest]:
        """`scheduled` with draft slots after the decoding requests that asked for them, as many
        as the budget left, the free blocks and each request's length limit allow (the drafts and
        the token sampled after them all fit)."""
        granted = []
        for item in scheduled:
            request = self.requests[item.request_id]
            asked = lookahead.get(item.request_id, 0)
            room = request.max_total_tokens - request.num_tokens - 1
            num_lookahead = min(asked, budget, room)
            decoding = (
                len(item.token_ids) == 1
                and item.start_position + 1 == request.num_tokens
                and not item.prompt
            )
            if (
                num_lookahead > 0
                and decoding
                and self.kv.allocate(request, 1, num_lookahead=num_lookahead)
            ):
                item = self._scheduled(request, 1, num_lookahead)
                budget -= num_lookahead
            granted.append(item)
        return granted

    def running_rows(self) -> int:
        """Tokens the running requests would compute this step before any draft slot (what
        `schedule` gives them, preemptions aside): the speculator's base for a step's cost."""
        budget, rows = self.config.max_num_batched_tokens, 0
        prompt_budget = self._prompt_budget(self._prompts_capped())
        for request in self.running:
            if self._is_in_flight(request):
                continue
            num_new = _share(request, budget, prompt_budget)
            rows += num_new
            budget -= num_new
            if _is_prompt(request):
                prompt_budget -= num_new
        return rows

    def _prompt_budget(self, capped: bool) -> int:
        """Prompt tokens this step may compute: the configured limit when `capped`
        (`_prompts_capped`), else the whole step's budget."""
        limit = self.config.max_prefill_tokens_while_decoding
        return limit if capped and limit is not None else self.config.max_num_batched_tokens

    def _prompts_capped(self) -> bool:
        """Whether a limit on prompt tokens per step is set and applies: while requests decoding
        (one new token to compute) are at least as many as those with a prompt still to prefill
        (one in flight included).

        A prompt token computed now delays each decoding request's next token by its cost, and
        brings the first token of every prompt in line (itself and those queued behind it) that
        much sooner: the cap pays only while it spares at least as many requests as it holds back.
        Waiting requests count only as far as there are free sequence slots to admit them: the
        others wait for a decoding request to finish, not for the prompts.
        """
        if self.config.max_prefill_tokens_while_decoding is None:
            return False
        decoding = sum(1 for r in self.running if not _is_prompt(r))
        admissible = min(len(self.waiting), self.config.max_num_seqs - len(self.running))
        return decoding >= len(self.running) - decoding + admissible

    def _allocate_or_preempt(self, request: Request, num_new: int, preempted: list[str]) -> bool:
        while not self.kv.allocate(request, num_new):
            # The newest running request, but not one whose chunk is in flight (it lands first).
            victim = next(r for r in reversed(self.running) if not self._is_in_flight(r))
            self.running.remove(victim)
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

    def _scheduled(
        self, request: Request, num_new: int, num_lookahead: int = 0
    ) -> ScheduledRequest:
        start = request.num_computed_tokens
        end = start + num_new
        return ScheduledRequest(
            request_id=request.request_id,
            token_ids=tuple(request.token_ids[start:end]),
            start_position=start,
            block_ids=tuple(self.kv.block_ids(request.request_id)),
            sample=end == request.num_tokens,
            num_lookahead=num_lookahead,
            prompt=start < request.num_prompt_tokens,
        )

    def update_after_step(self, output: SchedulerOutput) -> None:
        """The model computed every scheduled token: advance `num_computed_tokens`."""
        for item in output.scheduled:
            request = self.requests.get(item.request_id)
            if request is not None:
                request.num_computed_tokens = item.start_position + len(item.token_ids)

    def commit_drafts(self, request_id: str, num_accepted: int) -> None:
        """After a step with drafts: the first `num_accepted` drafts were kept (the request's tokens
        now hold them, their K/V written this step); the blocks only rejected drafts used go back
        to the pool."""
        request = self.requests.get(request_id)
        if request is None:  # finished on one of the tokens this step appended
            return
        request.num_computed_tokens += num_accepted
        assert request.num_computed_tokens < request.num_tokens
        self.kv.trim(request)

    def check_integrity(self) -> None:
        assert set(self.requests) == {r.request_id for r in self.running} | {
            r.request_id for r in self.waiting
        }
        assert all(r.status == RequestStatus.RUNNING for r in self.running)
        assert all(
            r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED) for r in self.waiting
        )
        assert all(not self.kv.block_ids(r.request_id) for r in self.waiting)
        # Between steps a running request holds exactly the blocks its computed tokens fill (and
        # those of its chunk in flight): no block a rejected draft used outlives its step.
        for r in self.running:
            held = len(self.kv.block_ids(r.request_id))
            computed = r.num_computed_tokens
            if self._is_in_flight(r):
                assert self.in_flight is not None
                computed = self.in_flight.start_position + len(self.in_flight.token_ids)
            assert held == blocks_needed(computed, self.kv.block_size), (
                f"{r.request_id} holds {held} blocks for {computed} computed tokens"
            )
        assert len(self.running) <= self.config.max_num_seqs
        self.kv.check_integrity()


def _is_prompt(request: Request) -> bool:
    """Whether a running request still has prompt tokens (or a recompute) to prefill, rather than
    one new token to decode."""
    return request.num_tokens - request.num_computed_tokens > 1


def _share(request: Request, budget: int, prompt_budget: int) -> int:
    """A running request's tokens this step: what it has left, within the step's budget and, for a
    prompt, within the prompt budget."""
    num_new = min(request.num_tokens - request.num_computed_tokens, budget)
    return min(num_new, prompt_budget) if _is_prompt(request) else num_new
