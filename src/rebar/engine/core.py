"""The engine core: requests in, one batched model step at a time, incremental outputs out.

Synchronous by design; `AsyncEngine` runs it in its own thread and `LLM` steps it directly. The
one computation beside its steps is a long prompt's chunk (`PrefillBeside`), which the scheduler
keeps apart from them. Every way a request can end goes through `_finish`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import replace

import torch
from torch import nn

from rebar import heap
from rebar.engine.admission import RequestChecker
from rebar.engine.detokenizer import IncrementalDetokenizer
from rebar.engine.engine_config import EngineConfig
from rebar.engine.grammar import Grammars, TokenMasks
from rebar.engine.kv_cache_manager import KVCacheManager
from rebar.engine.kv_cache_setup import build_kv_cache
from rebar.engine.outputs import (
    DEADLINE_EXCEEDED,
    ENGINE_FAULT,
    RequestOutput,
)
from rebar.engine.prefill_beside import PrefillBeside
from rebar.engine.request import AdmittedRequest, Request, RequestStatus
from rebar.engine.runner import ModelRunner
from rebar.engine.sampler import SampledToken, make_generator
from rebar.engine.sampling_params import SamplingParams
from rebar.engine.scheduler import ScheduledRequest, Scheduler, SchedulerConfig
from rebar.engine.sequence_state import (
    EngineSideState,
    append_token,
    request_timing,
    sampling_row,
    state_of,
)
from rebar.engine.spec.build import build_speculator
from rebar.engine.spec.draft_model import DraftModel
from rebar.engine.spec.speculator import Drafting, SequenceSpeculation, Speculator
from rebar.engine.stats import EngineStats
from rebar.engine.step_execution import execute_isolated
from rebar.engine.step_sampling import SamplingRow, StepSampler, Verdict, best_token_suffices
from rebar.errors import InvalidRequestError
from rebar.kernels.best_logits import BestTokens
from rebar.model.config import ModelConfig
from rebar.model.tokenizer import Tokenizer
from rebar.timing import DurationHistogram

logger = logging.getLogger("rebar.engine")


class EngineCore:
    def __init__(
        self,
        model: nn.Module,
        model_config: ModelConfig,
        tokenizer: Tokenizer,
        config: EngineConfig,
        dtype: torch.dtype,
        device: torch.device,
        draft: DraftModel | None = None,
    ) -> None:
        """`draft`: the loaded `config.draft_model` (its vocabulary already checked), when set."""
        heap.keep_freed_memory()  # each step's temporaries reused by the next (rebar.heap)
        self.config = config
        self.tokenizer = tokenizer
        self.max_model_len = min(
            config.max_model_len or model_config.max_position_embeddings,
            model_config.max_position_embeddings,
        )
        kv_cache = build_kv_cache(config, model_config, dtype, device, self.max_model_len, draft)
        num_blocks = kv_cache.num_blocks
        self.runner = ModelRunner(
            model, model_config, kv_cache, device, fused_decode=config.fused_decode
        )
        self.kv_manager = KVCacheManager(
            num_blocks, config.block_size, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(SchedulerConfig.of(config), self.kv_manager)
        # Threads share the CPU's cores; an accelerator would run the two one after the other.
        self.beside = (
            PrefillBeside(self.runner, config.prefill_beside_threads)
            if config.prefill_beside_decode and device.type == "cpu"
            else None
        )
        self._children: dict[str, list[str]] = {}  # caller's id -> ids of its scheduler requests
        self.grammars = Grammars(tokenizer, model_config.vocab_size)
        self.token_masks = TokenMasks(model_config.vocab_size)
        self.checker = RequestChecker(tokenizer.vocab_size, self.max_model_len, self.grammars)
        self.num_requests_added = 0
        self.step_seconds = {kind: DurationHistogram.empty() for kind in ("decode", "prefill")}
        if self.beside is not None:
            self.step_seconds["prefill_beside"] = self.beside.seconds
        self.step_sampler = StepSampler(self.token_masks)
        self.speculator: Speculator | None = (
            build_speculator(config, self.runner, num_blocks, draft) if config.speculative else None
        )

    # ----- admission ---------------------------------------------------------------------------
    def admit(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> AdmittedRequest:
        """The one check of a request (`RequestChecker.admit`): raises InvalidRequestError naming
        the parameter, else returns what `add_admitted` queues without checking again.

        Pure and thread-safe, so a front end can refuse bad input before it starts a response.
        """
        return self.checker.admit(prompt_token_ids, params)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        deadline: float | None = None,
        cache_salt: str | None = None,
    ) -> None:
        """`admit`, then `add_admitted`: for callers without a front door of their own."""
        self.add_admitted(request_id, self.admit(prompt_token_ids, params), deadline, cache_salt)

    def add_admitted(
        self,
        request_id: str,
        admitted: AdmittedRequest,
        deadline: float | None = None,
        cache_salt: str | None = None,
    ) -> None:
        """Queue an admitted request (n > 1 becomes n scheduler requests sharing the prompt's
        blocks).

        Prefix-cache blocks are shared only between requests with equal `cache_salt` (None
        included), so a per-tenant salt keeps one tenant from reusing, or timing, another's cached
        prompts.
        """
        if request_id in self._children:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise InvalidRequestError("cache_salt must be a string", "cache_salt")
        if not self.checker.issued(admitted):  # not this core's check: do it here
            admitted = self.admit(admitted.prompt_token_ids, admitted.params)
        params = admitted.params
        children = []
        for index in range(params.n):
            child_id = _child_id(request_id, index, params.n)
            if self.beside is not None and self.beside.computing(child_id):
                # A finished request of this id still has a chunk in flight: its blocks go first.
                self._land_beside(timeout=None)
            child_params = params if params.n == 1 else params.child(index)
            state = EngineSideState(
                parent_id=request_id,
                index=index,
                detokenizer=IncrementalDetokenizer(
                    self.tokenizer, params.stop, params.skip_special_tokens
                ),
                generator=make_generator(child_params),
                matcher=(
                    None if params.structured is None else self.grammars.matcher(params.structured)
                ),
                speculation=(
                    SequenceSpeculation()
                    if self.speculator is not None and params.speculative
                    else None
                ),
            )
            request = Request(
                child_id,
                list(admitted.prompt_token_ids),
                child_params,
                admitted.max_total_tokens,
                deadline=deadline,
                state=state,
                cache_salt=cache_salt,
            )
            children.append(request)
        self._children[request_id] = [r.request_id for r in children]
        self.num_requests_added += 1
        for request in children:
            self.scheduler.add_request(request)

    # ----- aborts and the single finish path ------------------------------------------------------
    def abort_request(self, request_id: str) -> list[RequestOutput]:
        """Finish every choice of `request_id` as aborted and free its blocks now; unknown ids are
        ignored."""
        return [
            self._finish(child, RequestStatus.FINISHED_ABORTED)
            for child in self._live_children(request_id)
        ]

    def fail_all(self, message: str) -> list[RequestOutput]:
        """Finish every live request with an error (engine shutdown or an unexpected fault)."""
        live = list(self.scheduler.requests.values())
        return [
            self._finish(r, RequestStatus.FINISHED_ERROR, error=message, keep_cached=False)
            for r in live
        ]

    def _live_children(self, request_id: str) -> list[Request]:
        return [
            self.scheduler.requests[c]
            for c in self._children.get(request_id, [])
            if c in self.scheduler.requests
        ]

    def _finish(
        self,
        request: Request,
        status: RequestStatus,
        delta: str = "",
        new_tokens: tuple[int, ...] = (),
        error: str | None = None,
        keep_cached: bool = True,
    ) -> RequestOutput:
        self.scheduler.finish_request(request.request_id, status, keep_cached=keep_cached)
        state = state_of(request)
        siblings = self._children.get(state.parent_id, [])
        if all(c not in self.scheduler.requests for c in siblings):
            self._children.pop(state.parent_id, None)
        if status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH):
            delta += state.detokenizer.finish()
        request.error = error
        request.finished_time = time.monotonic()
        return self._output(request, new_tokens, delta, finished=True)

    def _output(
        self, request: Request, new_tokens: tuple[int, ...], delta: str, finished: bool = False
    ) -> RequestOutput:
        state = state_of(request)
        logprobs = state.release_logprobs(final=finished)
        return RequestOutput(
            request_id=state.parent_id,
            index=state.index,
            new_token_ids=new_tokens,
            text_delta=delta,
            finished=finished,
            finish_reason=request.status.finish_reason if finished else None,
            stop_reason=request.stop_reason,
            logprobs=logprobs,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens,
            num_cached_tokens=request.num_cached_tokens,
            error=request.error,
            timing=request_timing(request) if finished else None,
        )

    # ----- one step ------------------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        """Whether a step has work: requests, or a chunk beside whose blocks a step must collect."""
        return self.scheduler.num_unfinished > 0 or (self.beside is not None and self.beside.busy)

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, sample, and report what every touched request produced.

        A step with nothing to run while a prompt chunk computes beside waits a little for it."""
        outputs = self._expire_deadlines() + self._land_beside()
        drafting = self._drafting()
        lookahead = None
        if self.speculator is not None and drafting:
            base_rows, running = self.scheduler.running_rows(), self.scheduler.running
            lookahead = self.speculator.lookahead(list(drafting.values()), base_rows, len(running))
        beside = self.beside
        plan = self.scheduler.schedule(lookahead, background=beside is not None and not beside.busy)
        started = time.monotonic()
        if plan.background is not None:
            assert beside is not None  # the scheduler starts a chunk only when asked to
            request = self.scheduler.requests[plan.background.request_id]
            request.scheduled_time = request.scheduled_time or started
            beside.start(plan.background)
        if plan.is_empty:
            return outputs + self._land_beside(timeout=0.05)
        for item in plan.scheduled:
            request = self.scheduler.requests[item.request_id]
            if request.scheduled_time is None:
                request.scheduled_time = started
        items = list(plan.scheduled)
        if self.speculator is not None and lookahead:
            items = self.speculator.attach_drafts(items, drafting)
        sampling = []
        for item in items:
            if item.sample:
                request = self.scheduler.requests[item.request_id]
                sampling.append((request, item, sampling_row(request, item)))
        greedy = all(best_token_suffices(row) for _, _, row in sampling)
        scores, failed = execute_isolated(self.runner, items, greedy)
        outputs += [self._fail(self.scheduler.requests[request_id]) for request_id in failed]
        self.scheduler.update_after_step(plan)
        sampling = [entry for entry in sampling if entry[1].request_id not in failed]
        outputs += self._sample_and_append(sampling, scores)
        decode = all(len(item.token_ids) == 1 for item in plan.scheduled)
        self.step_seconds["decode" if decode else "prefill"].observe(time.monotonic() - started)
        return outputs

    def _land_beside(self, timeout: float | None = 0.0) -> list[RequestOutput]:
        """Collect the prompt chunk computed beside the steps, if done (waiting up to `timeout`
        seconds, None: until it is): its request is scheduled again, or fails if it raised."""
        landed = None if self.beside is None else self.beside.landed(timeout)
        if landed is None:
            return []
        _, error = landed
        request = self.scheduler.land(failed=error is not None)
        return [] if request is None or error is None else [self._fail(request)]

    def _drafting(self) -> dict[str, Drafting]:
        """The running requests that take part in speculation, by id."""
        if self.speculator is None:
            return {}
        drafting = {}
        for request in self.scheduler.running:
            state = state_of(request)
            if state.speculation is not None:
                drafting[request.request_id] = Drafting(request, state.speculation, state.matcher)
        return drafting

    def _fail(
        self, request: Request, new_tokens: tuple[int, ...] = (), delta: str = ""
    ) -> RequestOutput:
        """Finish a request the engine could not serve; its K/V may be missing or garbage, so it is
        not cached. `new_tokens` and `delta`: what this step appended before the fault."""
        return self._finish(
            request,
            RequestStatus.FINISHED_ERROR,
            delta,
            new_tokens,
            error=ENGINE_FAULT,
            keep_cached=False,
        )

    def _sample_and_append(
        self,
        sampling: list[tuple[Request, ScheduledRequest, SamplingRow]],
        scores: torch.Tensor | BestTokens,
    ) -> list[RequestOutput]:
        """Sample each item's rows from `scores`: the step's logits, or its rows' best tokens when
        every row needs only those (`best_token_suffices`)."""
        if not sampling:
            return []
        rows = [row for _, _, row in sampling]
        verdicts = self.step_sampler.sample(rows, scores)
        outputs = []
        for (request, item, _), verdict in zip(sampling, verdicts):
            outputs += self._apply_verdict(request, verdict)
            if item.num_lookahead:
                self.scheduler.commit_drafts(request.request_id, verdict.num_accepted)
                speculation = state_of(request).speculation
                if self.speculator is not None and speculation is not None:
                    self.speculator.record(
                        speculation, len(item.draft_token_ids), verdict.num_accepted
                    )
        return outputs

    def _apply_verdict(self, request: Request, verdict: Verdict) -> list[RequestOutput]:
        """Append the verdict's tokens; a failed verdict fails the request after them."""
        outputs = []
        if verdict.tokens:
            try:
                outputs.append(self._append_tokens(request, verdict.tokens))
            except Exception:
                logger.exception("request %s failed", request.request_id)
                return [self._fail(request)]
        if verdict.failed and request.request_id in self.scheduler.requests:
            logger.error(
                "request %s: sampling failed (its logits hold NaN or no finite value)",
                request.request_id,
            )
            outputs.append(self._fail(request))
        return outputs

    def _append_tokens(self, request: Request, tokens: Sequence[SampledToken]) -> RequestOutput:
        """Append `tokens` in order, each through every stop check; the first that ends the
        request ends it (the rest are dropped, as a step without drafts would never reach them)."""
        state = state_of(request)
        if request.first_token_time is None:
            request.first_token_time = time.monotonic()
        new: list[int] = []
        delta = ""
        for token in tokens:
            new.append(token.token_id)
            status, token_delta = append_token(
                request, state, token, self.tokenizer.special.eos_token_ids
            )
            delta += token_delta
            if status == RequestStatus.FINISHED_ERROR:  # the refused token is not reported
                return self._fail(request, tuple(new[:-1]), delta)
            if status is not None:
                return self._finish(request, status, delta, tuple(new))
        return self._output(request, tuple(new), delta)

    def _expire_deadlines(self) -> list[RequestOutput]:
        now = time.monotonic()
        expired = [
            r
            for r in self.scheduler.requests.values()
            if r.deadline is not None and now >= r.deadline
        ]
        return [
            self._finish(r, RequestStatus.FINISHED_TIMEOUT, error=DEADLINE_EXCEEDED)
            for r in expired
        ]

    # ----- introspection -------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        pool = self.kv_manager.pool
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_free_blocks=pool.num_free_blocks,
            num_blocks=pool.num_blocks,
            kv_usage=pool.usage,
            num_prefix_queries=pool.num_prefix_queries,
            num_prefix_hits=pool.num_prefix_hits,
            num_preemptions=self.scheduler.num_preemptions,
            num_requests_added=self.num_requests_added,
            step_seconds={kind: h.copy() for kind, h in self.step_seconds.items()},
            grammar_mask_seconds=self.token_masks.seconds.copy(),
            drafts=(
                {}
                if self.speculator is None
                else {self.speculator.drafter.name: replace(self.speculator.counts)}
            ),
        )

    def logits(self, token_ids: list[int]) -> torch.Tensor:
        return self.runner.teacher_forced_logits(token_ids)

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()
        assert set(self._children) == {
            state_of(r).parent_id for r in self.scheduler.requests.values()
        }


def _child_id(request_id: str, index: int, n: int) -> str:
    """The scheduler's id of choice `index` of a request with `n` choices."""
    return request_id if n == 1 else f"{request_id}#{index}"
