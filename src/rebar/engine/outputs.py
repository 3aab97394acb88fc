"""What generation returns to callers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rebar.engine.sampler import TokenLogprobs

from rebar.timing import RequestTiming

# What `RequestOutput.error` says. Fixed texts, so no exception detail (paths, tensor shapes, device
# names) ever reaches a client; the log line for the failure carries the exception and request id.
ENGINE_FAULT = "the engine failed while generating this request; see the server log"
ENGINE_SHUTDOWN = "the engine shut down before this request finished"
DEADLINE_EXCEEDED = "deadline exceeded"


@dataclass(frozen=True)
class Choice:
    """One of the `n` completions of a prompt, finished.

    `finish_reason` and `error` are those of the choice's last output (see `RequestOutput`).
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str
    stop_reason: str | int | None = None
    logprobs: tuple[TokenLogprobs, ...] = ()  # one per generated token when requested
    error: str | None = None


@dataclass(frozen=True)
class CompletionOutput:
    """The finished generation for one prompt.

    `text`, `token_ids`, `finish_reason` and `stop_reason` are those of the first choice; all `n`
    choices are in `choices`. `token_ids` are every generated id (a final EOS or stop token
    included); `text` excludes special tokens (unless requested) and everything from a matched stop
    string on. `finish_reason` is "stop" (EOS, a stop token or a stop string), "length"
    (max_tokens or the context window), or "timeout"/"error"/"abort".
    """

    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str
    stop_reason: str | int | None = None
    choices: tuple[Choice, ...] = ()
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache

    @classmethod
    def from_outputs(
        cls, prompt_token_ids: list[int], outputs: OutputAccumulator
    ) -> CompletionOutput:
        choices = outputs.choices()
        first = choices[0]
        return cls(
            prompt_token_ids,
            first.text,
            first.token_ids,
            first.finish_reason,
            first.stop_reason,
            choices,
            outputs.num_cached_tokens,
        )


@dataclass(frozen=True)
class RequestOutput:
    """What one engine step produced for one choice of one request (incremental).

    `request_id` is the id the request was added under (for `AsyncEngine`, the engine's own unique
    id); `index` tells the choices of an `n > 1` request apart. The last output of a choice has
    `finished=True` and a `finish_reason`: "stop", "length", "abort", "timeout" or "error", and its
    `timing`. `error` is set on "timeout" and "error" outputs, always to one of the fixed texts
    DEADLINE_EXCEEDED, ENGINE_FAULT or ENGINE_SHUTDOWN, never to exception text.
    """

    request_id: str
    index: int
    new_token_ids: tuple[int, ...]
    text_delta: str
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: tuple[TokenLogprobs, ...] = ()  # one for each new token when requested
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None
    timing: RequestTiming | None = None  # on the last output of a choice


@dataclass
class _ChoiceSoFar:
    last: RequestOutput  # the choice's latest output
    # Each output's text delta; joined once when the choice is read (`+=` on an attribute copies
    # the whole text for every token).
    text_deltas: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)


class OutputAccumulator:
    """One request's incremental outputs gathered into whole choices: text, token ids, logprobs
    and how each ended. `LLM.generate` and the server's responses both build their answers on it.
    """

    def __init__(self) -> None:
        self._choices: dict[int, _ChoiceSoFar] = {}
        self.num_prompt_tokens = 0

    def add(self, output: RequestOutput) -> None:
        choice = self._choices.get(output.index)
        if choice is None:  # not setdefault: that would build a throwaway one for every token
            choice = self._choices[output.index] = _ChoiceSoFar(output)
        choice.text_deltas.append(output.text_delta)
        choice.token_ids.extend(output.new_token_ids)
        choice.logprobs.extend(output.logprobs)
        choice.last = output
        self.num_prompt_tokens = output.num_prompt_tokens

    @property
    def num_choices(self) -> int:
        """How many choices have produced at least one output."""
        return len(self._choices)

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens the prefix cache served the first choice (its siblings reuse its
        blocks)."""
        first = self._choices.get(0)
        return first.last.num_cached_tokens if first is not None else 0

    @property
    def num_completion_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self._choices.values())

    def choices(self) -> tuple[Choice, ...]:
        """Every choice seen, by index; one whose last output did not finish it counts as
        aborted."""
        return tuple(_finished(i, c) for i, c in sorted(self._choices.items()))

    def timing(self) -> RequestTiming | None:
        """The span of the finished choices (None before any finished)."""
        return RequestTiming.combine(
            c.last.timing for c in self._choices.values() if c.last.timing is not None
        )


def _finished(index: int, choice: _ChoiceSoFar) -> Choice:
    last = choice.last
    return Choice(
        index,
        "".join(choice.text_deltas),
        list(choice.token_ids),
        (last.finish_reason if last.finished else None) or "abort",
        last.stop_reason,
        tuple(choice.logprobs),
        last.error,
    )
