"""Prompts from request bodies, tokenized off the event loop when they are large.

A megabyte of text takes the tokenizer a second or two; on the event loop that would stall
every other client (even /health) for as long.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from rebar.engine.model_text import ModelText
from rebar.engine.prompt import Prompt, prompt_token_ids

INLINE_CHARS = 8192  # below this, tokenizing costs less than the hop to a worker thread
T = TypeVar("T")


async def off_loop(size: int, function: Callable[..., T], *args: Any) -> T:
    """`function(*args)`, on a worker thread when `size` (characters of input) is large."""
    if size <= INLINE_CHARS:
        return function(*args)
    return await asyncio.to_thread(function, *args)


def _chars(messages: Sequence[Mapping[str, Any]]) -> int:
    return sum(len(m.get("content") or "") for m in messages)


async def chat_prompt(
    llm: ModelText,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
    bos: bool = True,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> list[int]:
    """`ModelText.chat_prompt_ids`, off the loop for long conversations (/tokenize passes
    bos=False: bare ids)."""
    return await off_loop(
        _chars(messages), llm.chat_prompt_ids, messages, add_generation_prompt, bos, tools
    )


async def text_prompt(llm: ModelText, prompt: Prompt) -> list[int]:
    """Ids of a completions prompt (text or ids); control tokens written in the text are
    honoured."""
    return await off_loop(
        len(prompt) if isinstance(prompt, str) else 0, prompt_token_ids, llm.tokenizer, prompt
    )


async def count_tokens(llm: ModelText, texts: list[str]) -> int:
    """Tokens the embedding model sees for `texts` (its [CLS]/[SEP] included)."""

    def count() -> int:
        return sum(len(ids) for ids in llm.tokenizer.encode_batch(texts, add_special_tokens=True))

    return await off_loop(sum(len(t) for t in texts), count)
