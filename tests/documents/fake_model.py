"""A stand-in model for summary tests: counts words as tokens, answers each request with the
first sentence of every paragraph it was given (so statements really come from the pages), and
records what was in flight at once. Requests can be held open to test cancellation."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any


class FakeModel:
    version = "fake-v1"

    def __init__(
        self, context_tokens: int = 2048, hold: bool = False, fail_on: str | None = None
    ) -> None:
        self._context = context_tokens
        self.hold = hold  # requests wait until released (or cancelled)
        self.fail_on = fail_on  # a request whose text holds this raises
        self.released = asyncio.Event()
        self.in_flight = 0
        self.most_in_flight = 0
        self.started: list[str] = []
        self.cancelled = 0
        self.finished = 0

    @property
    def context_tokens(self) -> int:
        return self._context

    def count_tokens(self, text: str) -> int:
        return len(text.split())

    def prompt_tokens(self, messages: Sequence[Mapping[str, Any]]) -> int:
        return sum(self.count_tokens(m["content"]) + 4 for m in messages)

    async def stream(
        self, messages: Sequence[Mapping[str, Any]], max_tokens: int
    ) -> AsyncIterator[str]:
        prompt = messages[-1]["content"]
        self.started.append(prompt)
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            await asyncio.sleep(0)  # every request submitted before any answers
            if self.hold:
                await self.released.wait()
            if self.fail_on and self.fail_on in prompt:
                raise RuntimeError("the engine broke")
            words = answer(prompt).split()[:max_tokens]
            for index, word in enumerate(words):
                yield ("" if index == 0 else " ") + word
                await asyncio.sleep(0)
            self.finished += 1
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.in_flight -= 1


def answer(prompt: str) -> str:
    """The first sentence of each paragraph before the instruction (the prompt's last one)."""
    paragraphs = [p.strip() for p in prompt.split("\n\n")[:-1] if p.strip()]
    firsts = [re.split(r"(?<=[.!?])\s+", p)[0] for p in paragraphs]
    return " ".join(s if s.endswith((".", "!", "?")) else s + "." for s in firsts)
