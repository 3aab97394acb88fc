"""Reasoning models' thinking, told apart from their answer: `<think>…</think>` as DeepSeek-R1
distills and Qwen3 write it.

A model thinks when its chat template or its vocabulary names `</think>`. Its output opens with
`<think>` (leading whitespace aside), or starts inside the block when the prompt itself ends with
`<think>` (a template that opens it), so that only `</think>` appears. Everything before
`</think>` is `reasoning_content`; the rest, its leading newlines dropped, is `content`. A `<think>`
anywhere but at the start of an answer is text. Streams are split as they arrive: a tag cut between
two deltas is held back until the next one says what it is.
"""

from __future__ import annotations

from dataclasses import dataclass

from rebar.engine.model_text import ModelText

OPEN, CLOSE = "<think>", "</think>"


def thinks(llm: ModelText) -> bool:
    """Whether the model writes `<think>…</think>` blocks."""
    template = llm.checkpoint.chat_template or ""
    return CLOSE in template or llm.tokenizer.token_to_id(CLOSE) is not None


def opens_in_prompt(llm: ModelText, prompt_token_ids: list[int]) -> bool:
    """Whether the rendered prompt already opened the block (the template wrote `<think>`)."""
    tail = llm.tokenizer.decode(prompt_token_ids[-8:], skip_special_tokens=False)
    return tail.rstrip().endswith(OPEN)


def thinking_start(llm: ModelText, prompt_token_ids: list[int]) -> bool | None:
    """None for a model that does not think; else whether its answer starts inside the block."""
    return opens_in_prompt(llm, prompt_token_ids) if thinks(llm) else None


def _held_back(text: str, tag: str) -> int:
    """How many characters at the end of `text` could start `tag`."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


@dataclass
class ReasoningSplitter:
    """One choice's text, split into (reasoning, content) pieces as it streams."""

    inside: bool = False  # in the block now
    started: bool = False  # past the start of the answer, where `<think>` may open it
    after_close: bool = False  # just past `</think>`: its newlines are dropped
    pending: str = ""

    @classmethod
    def for_prompt(cls, opened: bool) -> ReasoningSplitter:
        return cls(inside=opened, started=opened)

    def feed(self, delta: str) -> tuple[str, str]:
        text, self.pending = self.pending + delta, ""
        reasoning, content = [], []
        while text:
            if not self.started:
                stripped = text.lstrip()
                if stripped.startswith(OPEN):
                    text, self.inside, self.started = stripped[len(OPEN) :], True, True
                elif stripped and OPEN.startswith(stripped):
                    self.pending = text  # `<thi`: wait for the rest
                    break
                elif stripped:
                    self.started = True
                else:
                    self.pending = text  # only whitespace so far
                    break
            elif self.inside:
                end = text.find(CLOSE)
                if end >= 0:
                    reasoning.append(text[:end])
                    text, self.inside, self.after_close = text[end + len(CLOSE) :], False, True
                    continue
                keep = _held_back(text, CLOSE)
                reasoning.append(text[: len(text) - keep])
                self.pending = text[len(text) - keep :]
                break
            else:
                if self.after_close:
                    text = text.lstrip("\n")
                    if not text:
                        break
                    self.after_close = False
                content.append(text)
                break
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """What was held back, once the choice has ended."""
        text, self.pending = self.pending, ""
        return (text, "") if self.inside else ("", text)


def split(text: str, opened: bool) -> tuple[str, str]:
    """A whole answer as (reasoning, content)."""
    splitter = ReasoningSplitter.for_prompt(opened)
    reasoning, content = splitter.feed(text)
    rest_reasoning, rest_content = splitter.finish()
    return reasoning + rest_reasoning, content + rest_content
