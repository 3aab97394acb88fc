"""One generation request on its way through the pipeline's stages (`Call`, filled in as it goes
down), and what comes back up (`Outcome`, completed as it goes up).

Each stage is `async def run(call, next) -> Outcome`: it does its part, hands the call to the
next stage, and finishes its part on the returned outcome, so a request goes down through each
stage once and comes back up through each once.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from starlette.requests import Request

from rebar.engine.outputs import RequestOutput
from rebar.server.context import RequestContext
from rebar.server.pipeline.request import GenerationRequest
from rebar.server.pipeline.results import Answer, Completion, StreamItem

if TYPE_CHECKING:  # types only: the stages that make them import this module
    from rebar.server.pipeline.gate import Pass
    from rebar.server.pipeline.prepare import Prepared
    from rebar.server.state import ServerState
    from rebar.serving.instances import ChatModel

# A live stream as the engine side produces it: outputs, None for a keep-alive, and at the end the
# whole answer (when every choice finished).
Live = AsyncGenerator[RequestOutput | Completion | None, None]


@dataclass
class Call:
    """The request and what the stages found for it: the leased model version (lease), the
    prompt and how to read the answer (prepare), the gate's pass (gate)."""

    state: ServerState
    http: Request
    request: GenerationRequest
    context: RequestContext
    model: ChatModel | None = None
    prepared: Prepared | None = None
    passed: Pass | None = None


@dataclass
class Outcome:
    """The answer coming back up: from the engine side a whole `completion` or a `live` stream;
    read for the client (prepare) as a whole `answer` or stream `items`. `headers` gathers what
    the stages add to the response (rate limits, cache, model version)."""

    completion: Completion | None = None
    live: Live | None = None
    answer: Answer | None = None
    items: AsyncGenerator[StreamItem, None] | None = None
    headers: dict[str, str] = field(default_factory=dict)


Next = Callable[[Call], Awaitable[Outcome]]
