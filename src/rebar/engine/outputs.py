"""What generation returns to callers."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CompletionOutput:
    """One finished generation.

    `token_ids` are every generated id (a final EOS or stop token included); `text` excludes special
    tokens (unless requested) and everything from a matched stop string on. `finish_reason` is
    "stop" (EOS, a stop token or a stop string) or "length" (max_tokens or the context window).
    """

    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str
    stop_reason: str | int | None = None  # the stop string or stop token id that matched


@dataclass(frozen=True)
class StepOutput:
    """One token for one sequence: the text it released and, on the last one, why it ended."""

    index: int  # position of the prompt in the batch
    token_id: int
    text_delta: str
    finish_reason: str | None = None
    stop_reason: str | int | None = None
