"""The model a summary runs on, seen as text in and streamed text out. `EngineGenerator` runs it
on an engine front (the server's engine thread or process, or one the CLI starts): every request
of a summary is submitted at once, so the engine batches them."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any, Protocol

from rebar.engine.async_engine import EngineFront
from rebar.engine.model_text import ModelText
from rebar.engine.sampling_params import SamplingParams
from rebar.errors import RebarError

Messages = Sequence[Mapping[str, Any]]
# Greedy, with a mild penalty: a small model left greedy repeats its last sentence until the limit.
REPETITION_PENALTY = 1.15


class SummaryFailed(RebarError):
    """The engine failed while generating part of a summary."""


class Generator(Protocol):
    """A chat model: its context window, its token counts, and a text stream for messages."""

    version: str  # what summaries are cached under, with the document and the style

    @property
    def context_tokens(self) -> int: ...

    def count_tokens(self, text: str) -> int: ...

    def prompt_tokens(self, messages: Messages) -> int: ...

    def stream(self, messages: Messages, max_tokens: int) -> AsyncIterator[str]: ...


class EngineGenerator:
    """A `Generator` over an engine front and its model's text side (tokenizer, chat template)."""

    def __init__(self, front: EngineFront, text: ModelText, version: str) -> None:
        self.front, self.text, self.version = front, text, version

    @property
    def context_tokens(self) -> int:
        return self.front.max_model_len

    def count_tokens(self, text: str) -> int:
        return len(self.text.tokenizer.encode(text))

    def prompt_tokens(self, messages: Messages) -> int:
        return len(self.text.chat_prompt_ids(messages))

    async def stream(self, messages: Messages, max_tokens: int) -> AsyncIterator[str]:
        """Text deltas of a greedy answer; leaving early (a cancelled summary) aborts it."""
        params = SamplingParams(
            max_tokens=max_tokens, temperature=0.0, repetition_penalty=REPETITION_PENALTY
        )
        outputs = self.front.generate(self.text.chat_prompt_ids(messages), params)
        try:
            async for output in outputs:
                if output.error is not None:
                    raise SummaryFailed(f"summarising failed: {output.error}")
                yield output.text_delta
        finally:
            await outputs.aclose()
