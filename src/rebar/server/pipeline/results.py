"""What the pipeline hands back to a dialect: finished answers and stream events in no API's shape.

`Completion` is an answer as the engine produced it (and as the response cache stores it);
`Answer` is the same read for the client: each choice's reasoning, content and tool calls apart,
token logprobs with their text. A stream is a sequence of `Ping`, `list[Event]` (what one engine
output added) and a final `StreamEnd`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rebar.engine.outputs import Choice, OutputAccumulator
from rebar.engine.sampler import TokenLogprobs
from rebar.timing import RequestTiming

OUT_OF_TOKENS = "rate_limited"  # the finish reason of a choice cut by the tokens-per-minute limit


@dataclass(frozen=True)
class Completion:
    """A finished answer as the engine produced it, and as the cache stores it (JSON).

    Choices replayed from the cache carry no token ids: it keeps their text, logprobs and how they
    finished, and the completion's token count.
    """

    choices: tuple[Choice, ...]
    num_prompt_tokens: int
    num_completion_tokens: int
    num_cached_tokens: int = 0
    timing: RequestTiming | None = None  # the engine's; None for a cache hit (never stored)

    @classmethod
    def from_outputs(cls, outputs: OutputAccumulator, num_prompt_tokens: int) -> Completion:
        return cls(
            outputs.choices(),
            num_prompt_tokens,
            outputs.num_completion_tokens,
            outputs.num_cached_tokens,
            outputs.timing(),
        )

    @property
    def cacheable(self) -> bool:
        return all(c.finish_reason in ("stop", "length") for c in self.choices)

    def to_json(self) -> dict:
        return {
            "choices": [
                {
                    "index": c.index,
                    "text": c.text,
                    "finish_reason": c.finish_reason,
                    "stop": c.stop_reason if isinstance(c.stop_reason, str) else None,
                    "logprobs": [
                        [e.token_id, e.logprob, [list(t) for t in e.top]] for e in c.logprobs
                    ],
                }
                for c in self.choices
            ],
            "usage": [self.num_prompt_tokens, self.num_completion_tokens],
        }

    @classmethod
    def from_json(cls, data: dict, num_prompt_tokens: int) -> Completion:
        choices = tuple(
            Choice(
                c["index"],
                c["text"],
                [],
                c["finish_reason"],
                c.get("stop"),
                logprobs=tuple(
                    TokenLogprobs(t, lp, tuple((a, b) for a, b in top))
                    for t, lp, top in c["logprobs"]
                ),
            )
            for c in data["choices"]
        )
        # A hit computes nothing: every prompt token counts as cached.
        return cls(choices, num_prompt_tokens, data["usage"][1], num_prompt_tokens)


@dataclass(frozen=True)
class TokenLogprob:
    """One sampled token: its text, log-probability and the most likely alternatives."""

    token: str
    logprob: float
    top: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True)
class ToolCall:
    """A call the answer made; `arguments` is JSON text (an object)."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class AnswerChoice:
    """One choice read for the client. `reasoning` is None for a model that does not think.
    `finish_reason` is the engine's: stop, length, abort, timeout, error, or OUT_OF_TOKENS."""

    index: int
    content: str
    reasoning: str | None
    tool_calls: tuple[ToolCall, ...]
    finish_reason: str | None
    logprobs: tuple[TokenLogprob, ...] | None  # None unless the request asked for them
    error: str | None = None
    stop_sequence: str | None = None  # the stop string that ended it, if one did


@dataclass(frozen=True)
class Answer:
    choices: tuple[AnswerChoice, ...]
    usage: Usage
    # queue/prefill/decode milliseconds and cached prompt tokens; None when nothing was computed
    # (an answer from the response cache)
    timing: dict[str, Any] | None


@dataclass(frozen=True)
class Delta:
    """Text a choice added: its content and (a thinking model's) reasoning."""

    index: int
    content: str = ""
    reasoning: str = ""
    logprobs: tuple[TokenLogprob, ...] | None = None


@dataclass(frozen=True)
class ToolCallDelta:
    """Part of a tool call: the first for a call has its `id` and `name`, later ones more of its
    `arguments` (JSON text, in fragments)."""

    index: int
    call_index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass(frozen=True)
class ChoiceEnd:
    """A choice finished; `error` says why when it ended by timeout or failure, `stop_sequence`
    which stop string ended it, if one did."""

    index: int
    finish_reason: str | None
    has_tool_calls: bool = False
    error: str | None = None
    stop_sequence: str | None = None


Event = Delta | ToolCallDelta | ChoiceEnd


@dataclass(frozen=True)
class Ping:
    """Nothing new for a while (a long prefill): a dialect may send a keep-alive."""


@dataclass(frozen=True)
class StreamEnd:
    """Every choice has finished."""

    usage: Usage
    timing: dict[str, Any] | None  # None for an answer replayed from the cache


StreamItem = Ping | list[Event] | StreamEnd
PING = Ping()


def timing_fields(timing: RequestTiming | None, num_cached: int) -> dict[str, Any]:
    """The engine's time split of one answer, in milliseconds, the prompt tokens the prefix cache
    served, and the draft tokens speculative decoding checked and kept."""
    if timing is None:
        return {
            "queue_ms": 0.0,
            "prefill_ms": 0.0,
            "decode_ms": 0.0,
            "cached_prompt_tokens": num_cached,
            "draft_tokens": 0,
            "accepted_draft_tokens": 0,
        }
    return {
        "queue_ms": round(timing.queue_s * 1e3, 2),
        "prefill_ms": round(timing.prefill_s * 1e3, 2),
        "decode_ms": round(timing.decode_s * 1e3, 2),
        "cached_prompt_tokens": num_cached,
        "draft_tokens": timing.num_draft_tokens,
        "accepted_draft_tokens": timing.num_accepted_tokens,
    }
