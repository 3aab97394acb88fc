"""What generation returns to callers."""

from __future__ import annotations

from dataclasses import dataclass

from rebar.timing import RequestTiming

# What `RequestOutput.error` says. Fixed texts, so no exception detail (paths, tensor shapes, device
# names) ever reaches a client; the log line for the failure carries the exception and request id.
ENGINE_FAULT = "the engine failed while generating this request; see the server log"
ENGINE_SHUTDOWN = "the engine shut down before this request finished"
DEADLINE_EXCEEDED = "deadline exceeded"


@dataclass(frozen=True)
class Choice:
    """One of the `n` completions of a prompt."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str
    stop_reason: str | int | None = None
    logprobs: tuple = ()  # TokenLogprobs per generated token when requested
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
    def from_choices(
        cls, prompt_token_ids: list[int], choices: tuple[Choice, ...], last: RequestOutput
    ) -> CompletionOutput:
        first = choices[0]
        return cls(
            prompt_token_ids,
            first.text,
            first.token_ids,
            first.finish_reason,
            first.stop_reason,
            choices,
            last.num_cached_tokens,
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
    logprobs: tuple = ()  # TokenLogprobs for each new token when requested
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None
    timing: RequestTiming | None = None  # on the last output of a choice
