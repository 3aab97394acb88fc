"""Running an engine core to completion in the calling thread: the synchronous loop behind the
offline `rebar.LLM` and the golden continuations of model contracts."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import replace

from rebar import heap
from rebar.engine.core import EngineCore
from rebar.engine.outputs import CompletionOutput, OutputAccumulator, RequestOutput
from rebar.engine.request import AdmittedRequest

_ids = itertools.count()


def stream(core: EngineCore, admitted: Sequence[AdmittedRequest]) -> Iterator[RequestOutput]:
    """Step `core` until every request of `admitted` has finished, yielding their outputs as each
    step produces them, with `request_id` = the request's position as a string. Stopping the
    iteration early aborts what is still running."""
    request_ids = [f"run-{next(_ids)}" for _ in admitted]
    names = {rid: str(i) for i, rid in enumerate(request_ids)}
    try:
        for rid, request in zip(request_ids, admitted):
            core.add_admitted(rid, request)
        while core.has_unfinished_requests():
            for output in core.step():
                if output.request_id in names:
                    yield replace(output, request_id=names[output.request_id])
        heap.trim()  # idle: the steps' freed temporaries go back to the OS
    finally:
        for rid in request_ids:
            core.abort_request(rid)


def complete(core: EngineCore, admitted: Sequence[AdmittedRequest]) -> list[CompletionOutput]:
    """Every request of `admitted` run to its end; one output per request, in order."""
    collected = [OutputAccumulator() for _ in admitted]
    for output in stream(core, admitted):
        collected[int(output.request_id)].add(output)
    return [
        CompletionOutput.from_outputs(list(request.prompt_token_ids), outputs)
        for request, outputs in zip(admitted, collected)
    ]
