"""The engine core: requests in, one batched model step at a time, incremental outputs out.

Synchronous and single-threaded by design; `AsyncEngine` runs it in its own thread and `LLM`
steps it directly. Every way a request can end goes through `_finish`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from rebar.engine.admission import RequestChecker
from rebar.engine.detokenizer import IncrementalDetokenizer
from rebar.engine.engine_config import EngineConfig, kv_bytes_per_token, num_kv_blocks
from rebar.engine.grammar import GrammarMatcher, Grammars, StepMask, TokenMasks
from rebar.engine.kv_cache_manager import KVCacheManager
from rebar.engine.outputs import (
    DEADLINE_EXCEEDED,
    ENGINE_FAULT,
    RequestOutput,
)
from rebar.engine.request import AdmittedRequest, Request, RequestStatus
from rebar.engine.runner import ModelRunner
from rebar.engine.sampler import (
    SampledToken,
    SampleRequest,
    make_generator,
    sample_batch,
)
from rebar.engine.sampling_params import SamplingParams
from rebar.engine.scheduler import ScheduledRequest, Scheduler, SchedulerConfig
from rebar.errors import InvalidRequestError
from rebar.kernels.attention import KVCache
from rebar.model.config import ModelConfig
from rebar.model.tokenizer import Tokenizer
from rebar.timing import DurationHistogram, RequestTiming

logger = logging.getLogger("rebar.engine")


@dataclass
class EngineSideState:
    """Engine-side companions of a scheduler Request."""

    parent_id: str
    index: int
    detokenizer: IncrementalDetokenizer
    generator: torch.Generator | None
    matcher: GrammarMatcher | None = None  # where the output stands in its grammar, if it has one
    # Logprobs wait here, with the offset where their token's text starts, until that text is
    # released: a stream never reports a token whose text it has not shown (held-back stop-string
    # prefixes, EOS and stop tokens are never shown).
    pending_logprobs: list[tuple[int, object]] = field(default_factory=list)

    def release_logprobs(self, final: bool) -> tuple:
        released = self.detokenizer.num_released_chars
        ready = [entry for start, entry in self.pending_logprobs if start < released]
        self.pending_logprobs = (
            [] if final else [(s, e) for s, e in self.pending_logprobs if s >= released]
        )
        return tuple(ready)


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_blocks: int
    kv_usage: float
    num_prefix_queries: int
    num_prefix_hits: int
    num_preemptions: int
    num_requests_added: int  # every accepted request (an n > 1 request counts once)
    # Durations of whole steps (schedule, model, sampling, outputs) by kind: "decode" when every
    # scheduled request computed one token, else "prefill" (prompt tokens in the step).
    step_seconds: dict[str, DurationHistogram] = field(default_factory=dict)
    # Per step with grammar-constrained rows: filling and applying their token masks.
    grammar_mask_seconds: DurationHistogram | None = None


class EngineCore:
    def __init__(
        self,
        model: nn.Module,
        model_config: ModelConfig,
        tokenizer: Tokenizer,
        config: EngineConfig,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.max_model_len = min(
            config.max_model_len or model_config.max_position_embeddings,
            model_config.max_position_embeddings,
        )
        kv_dtype = config.kv_dtype(dtype, device)
        num_blocks = num_kv_blocks(config, model_config, kv_dtype, device)
        if num_blocks * config.block_size < self.max_model_len:
            raise InvalidRequestError(
                f"the KV cache holds {num_blocks * config.block_size} tokens, fewer than "
                f"max_model_len={self.max_model_len}; raise kv_cache_memory or lower max_model_len",
                "kv_cache_memory",
            )
        kv_cache = KVCache(
            model_config.num_layers,
            num_blocks,
            config.block_size,
            model_config.num_kv_heads,
            model_config.head_dim,
            kv_dtype,
            device,
        )
        logger.info(
            "KV cache: %d blocks x %d tokens = %d tokens, %.1f MiB (%s, %d bytes/token)",
            num_blocks,
            config.block_size,
            num_blocks * config.block_size,
            kv_cache.num_bytes / 2**20,
            kv_dtype,
            kv_bytes_per_token(model_config, kv_dtype),
        )
        self.runner = ModelRunner(
            model, model_config, kv_cache, device, fused_decode=config.fused_decode
        )
        self.kv_manager = KVCacheManager(
            num_blocks, config.block_size, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(SchedulerConfig.of(config), self.kv_manager)
        self._children: dict[str, list[str]] = {}  # caller's id -> ids of its scheduler requests
        self.grammars = Grammars(tokenizer, model_config.vocab_size)
        self.token_masks = TokenMasks(model_config.vocab_size)
        self.checker = RequestChecker(tokenizer.vocab_size, self.max_model_len, self.grammars)
        self.num_requests_added = 0
        self.step_seconds = {kind: DurationHistogram.empty() for kind in ("decode", "prefill")}

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
            child_params = params if params.n == 1 else params.child(index)
            child_id = request_id if params.n == 1 else f"{request_id}#{index}"
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
        state = _state_of(request)
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
        state = _state_of(request)
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
            timing=_timing(request) if finished else None,
        )

    # ----- one step ------------------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, sample, and report what every touched request produced."""
        outputs = self._expire_deadlines()
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return outputs
        started = time.monotonic()
        for item in plan.scheduled:
            request = self.scheduler.requests[item.request_id]
            if request.scheduled_time is None:
                request.scheduled_time = started
        logits, failed = self._execute(plan.scheduled)
        outputs += [self._fail(self.scheduler.requests[request_id]) for request_id in failed]
        self.scheduler.update_after_step(plan)
        sampling = [
            self.scheduler.requests[item.request_id]
            for item in plan.scheduled
            if item.sample and item.request_id not in failed
        ]
        outputs += self._sample_and_append(sampling, logits)
        decode = all(len(item.token_ids) == 1 for item in plan.scheduled)
        self.step_seconds["decode" if decode else "prefill"].observe(time.monotonic() - started)
        return outputs

    def _execute(self, items: Sequence[ScheduledRequest]) -> tuple[torch.Tensor, list[str]]:
        """The step's logits (one row per surviving item with `sample`, in order) and the failed
        request ids.

        When the batch fails, each item runs alone, in order, so only the requests that fail by
        themselves fail. Rerunning an item is harmless: the runner writes K/V only at the item's own
        slots, computed from its tokens and positions, so a rerun rewrites the same values.
        """
        try:
            return self.runner.execute(items), []
        except Exception:
            logger.exception(
                "model step failed for requests %s; running each alone",
                [i.request_id for i in items],
            )
        rows: list[torch.Tensor] = [torch.empty(0, self.runner.config.vocab_size)]
        failed: list[str] = []
        unwritten: set[int] = set()  # blocks whose K/V a failed item was to write this step
        for item in items:
            # A prefix hit taken this step may read blocks that an earlier item was to fill.
            depends_on_failed = not unwritten.isdisjoint(item.block_ids)
            if depends_on_failed:
                logger.error(
                    "request %s reads KV blocks that a failed request was to write; failing it too",
                    item.request_id,
                )
            item_logits = None if depends_on_failed else self._execute_alone(item)
            if item_logits is None:
                failed.append(item.request_id)
                unwritten.update(self._blocks_written(item))
            else:
                rows.append(item_logits)
        return torch.cat(rows), failed

    def _execute_alone(self, item: ScheduledRequest) -> torch.Tensor | None:
        try:
            return self.runner.execute([item])
        except Exception:
            logger.exception("model step failed for request %s alone", item.request_id)
            return None

    def _blocks_written(self, item: ScheduledRequest) -> tuple[int, ...]:
        block_size = self.config.block_size
        first, last = (
            item.start_position // block_size,
            (item.start_position + len(item.token_ids) - 1) // block_size,
        )
        return item.block_ids[first : last + 1]

    def _fail(self, request: Request) -> RequestOutput:
        """Finish a request the engine could not serve; its K/V may be missing or garbage, so it is
        not cached."""
        return self._finish(
            request, RequestStatus.FINISHED_ERROR, error=ENGINE_FAULT, keep_cached=False
        )

    def _sample_and_append(
        self, requests: list[Request], logits: torch.Tensor
    ) -> list[RequestOutput]:
        if not requests:
            return []
        outputs = []
        # Token histories are only read by penalties; copying them every step would cost O(length).
        rows = [
            SampleRequest(r.params, _state_of(r).generator, r.prompt_token_ids, r.output_token_ids)
            if r.params.has_penalties
            else SampleRequest(r.params, _state_of(r).generator, (), ())
            for r in requests
        ]
        constrained = [
            (i, matcher)
            for i, r in enumerate(requests)
            if (matcher := _state_of(r).matcher) is not None
        ]
        mask = self.token_masks.fill(constrained) if constrained else None
        try:
            sampled = sample_batch(logits, rows, mask)
        except Exception:  # isolate the row that cannot be sampled
            logger.exception("batched sampling failed; sampling rows one at a time")
            sampled = [
                self._sample_one(logits[i : i + 1], row, mask and mask.for_row(i))
                for i, row in enumerate(rows)
            ]
        for request, token in zip(requests, sampled):
            if token is None:
                logger.error(
                    "request %s: sampling failed (its logits hold NaN or no finite value)",
                    request.request_id,
                )
                outputs.append(self._fail(request))
                continue
            try:
                outputs.append(self._append_token(request, token))
            except Exception:
                logger.exception("request %s failed", request.request_id)
                outputs.append(self._fail(request))
        return outputs

    @staticmethod
    def _sample_one(
        logits: torch.Tensor, row: SampleRequest, mask: StepMask | None
    ) -> SampledToken | None:
        try:
            return sample_batch(logits, [row], mask)[0]
        except Exception:
            logger.exception("sampling one row failed")
            return None

    def _append_token(self, request: Request, token: SampledToken) -> RequestOutput:
        state = _state_of(request)
        token_id = token.token_id
        if request.first_token_time is None:
            request.first_token_time = time.monotonic()
        request.append_output(token_id)
        params = request.params
        new = (token_id,)
        if state.matcher is not None and not state.matcher.consume(token_id):
            # The mask allowed only tokens the grammar accepts; this is a fault, not the model.
            logger.error(
                "request %s: the grammar refused token %d: %s",
                request.request_id,
                token_id,
                state.matcher.error,
            )
            return self._fail(request)
        if token_id in self.tokenizer.special.eos_token_ids and not params.ignore_eos:
            return self._finish(request, RequestStatus.FINISHED_STOPPED, new_tokens=new)
        if token_id in params.stop_token_ids:
            request.stop_reason = token_id
            return self._finish(request, RequestStatus.FINISHED_STOPPED, new_tokens=new)
        if token.logprobs is not None:
            state.pending_logprobs.append((len(state.detokenizer.text), token.logprobs))
        delta = state.detokenizer.add(token_id)
        if state.detokenizer.stopped:
            request.stop_reason = state.detokenizer.stop_string
            return self._finish(request, RequestStatus.FINISHED_STOPPED, delta, new)
        if state.matcher is not None and state.matcher.done:
            # Nothing may follow a complete output (not even under ignore_eos): every way on
            # from here finishes, so a sequence is never sampled past its grammar's end.
            return self._finish(request, RequestStatus.FINISHED_STOPPED, delta, new)
        if request.num_tokens >= request.max_total_tokens:
            return self._finish(request, RequestStatus.FINISHED_LENGTH, delta, new)
        return self._output(request, new, delta)

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
        )

    def logits(self, token_ids: list[int]) -> torch.Tensor:
        return self.runner.teacher_forced_logits(token_ids)

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()
        assert set(self._children) == {
            _state_of(r).parent_id for r in self.scheduler.requests.values()
        }


def _timing(request: Request) -> RequestTiming:
    assert request.finished_time is not None, "timing is reported once the request finished"
    return RequestTiming(
        request.arrival_time,
        request.scheduled_time,
        request.first_token_time,
        request.finished_time,
    )


def _state_of(request: Request) -> EngineSideState:
    state = request.state
    assert isinstance(state, EngineSideState), f"{request.request_id} was not queued by this core"
    return state
