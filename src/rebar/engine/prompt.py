"""Prompts as the model sees them: text is tokenized and gets BOS when the model asks for one."""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

from rebar.errors import InvalidRequestError
from rebar.model.tokenizer import Tokenizer

Prompt = str | Sequence[int]


def prompt_token_ids(tokenizer: Tokenizer, prompt: Prompt) -> list[int]:
    """Token ids for a text or id-list prompt. Range and length checks happen at admission."""
    if isinstance(prompt, str):
        return with_bos(tokenizer, tokenizer.encode(prompt))
    if isinstance(prompt, Sequence):
        return list(cast(Sequence[int], prompt))  # the ids are checked at admission
    raise InvalidRequestError("prompt must be a string or a list of token ids", "prompt")


def with_bos(tokenizer: Tokenizer, ids: list[int]) -> list[int]:
    """`ids` (of a text prompt) led by BOS when the model asks for one and it is not there yet."""
    bos = tokenizer.special.bos_token_id
    if tokenizer.special.add_bos and bos is not None and (not ids or ids[0] != bos):
        ids.insert(0, bos)
    return ids
