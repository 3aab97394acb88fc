"""The engine core's companions of a scheduler request, and how one sampled token joins it.

A `Request` is what the scheduler sees (tokens, blocks); its `EngineSideState` holds what only the
core needs: the sampler's generator, the detokenizer, the grammar matcher, pending logprobs and
its speculation. `append_token` is the one place a token is appended and checked against every way
a request can stop. `sampling_row` and `request_timing` read a request with its state for the
sampler and for its final output.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from dataclasses import dataclass, field

import torch

from rebar.engine.detokenizer import IncrementalDetokenizer
from rebar.engine.grammar import GrammarMatcher
from rebar.engine.request import Request, RequestStatus
from rebar.engine.sampler import SampledToken
from rebar.engine.scheduler import ScheduledRequest
from rebar.engine.spec.speculator import SequenceSpeculation
from rebar.engine.step_sampling import SamplingRow
from rebar.timing import RequestTiming

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
    speculation: SequenceSpeculation | None = None  # when the engine drafts tokens

    def release_logprobs(self, final: bool) -> tuple:
        released = self.detokenizer.num_released_chars
        ready = [entry for start, entry in self.pending_logprobs if start < released]
        self.pending_logprobs = (
            [] if final else [(s, e) for s, e in self.pending_logprobs if s >= released]
        )
        return tuple(ready)


def append_token(
    request: Request,
    state: EngineSideState,
    token: SampledToken,
    eos_token_ids: Collection[int],
) -> tuple[RequestStatus | None, str]:
    """Append one token through every stop check; returns how it ends the request (None: it goes
    on; FINISHED_ERROR: the grammar refused it, a fault) and the text it releases."""
    token_id = token.token_id
    request.append_output(token_id)
    params = request.params
    if state.matcher is not None and not state.matcher.consume(token_id):
        # The mask allowed only tokens the grammar accepts; this is a fault, not the model.
        logger.error(
            "request %s: the grammar refused token %d: %s",
            request.request_id,
            token_id,
            state.matcher.error,
        )
        return RequestStatus.FINISHED_ERROR, ""
    if token_id in eos_token_ids and not params.ignore_eos:
        return RequestStatus.FINISHED_STOPPED, ""
    if token_id in params.stop_token_ids:
        request.stop_reason = token_id
        return RequestStatus.FINISHED_STOPPED, ""
    if token.logprobs is not None:
        state.pending_logprobs.append((len(state.detokenizer.text), token.logprobs))
    delta = state.detokenizer.add(token_id)
    if state.detokenizer.stopped:
        request.stop_reason = state.detokenizer.stop_string
        return RequestStatus.FINISHED_STOPPED, delta
    if state.matcher is not None and state.matcher.done:
        # Nothing may follow a complete output (not even under ignore_eos): every way on
        # from here finishes, so a sequence is never sampled past its grammar's end.
        return RequestStatus.FINISHED_STOPPED, delta
    if request.num_tokens >= request.max_total_tokens:
        return RequestStatus.FINISHED_LENGTH, delta
    return None, delta


def state_of(request: Request) -> EngineSideState:
    state = request.state
    assert isinstance(state, EngineSideState), f"{request.request_id} was not queued by this core"
    return state


def sampling_row(request: Request, item: ScheduledRequest) -> SamplingRow:
    """What `request` brings to the sampling of `item`'s rows."""
    state = state_of(request)
    # Token histories are only read by penalties; copying them every step would cost O(length).
    penalised = request.params.has_penalties
    drawn = None if state.speculation is None else state.speculation.draft_probabilities
    if drawn is not None and item.draft_token_ids:
        drawn = drawn[: len(item.draft_token_ids)]
    else:
        drawn = None
    return SamplingRow(
        request.params,
        state.generator,
        request.prompt_token_ids if penalised else (),
        request.output_token_ids if penalised else (),
        state.matcher,
        item.draft_token_ids,
        drawn,
    )


def request_timing(request: Request) -> RequestTiming:
    assert request.finished_time is not None, "timing is reported once the request finished"
    speculation = state_of(request).speculation
    return RequestTiming(
        request.arrival_time,
        request.scheduled_time,
        request.first_token_time,
        request.finished_time,
        0 if speculation is None else speculation.num_drafted,
        0 if speculation is None else speculation.num_accepted,
    )
