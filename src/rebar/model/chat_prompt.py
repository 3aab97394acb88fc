"""Token ids of a chat prompt in which message contents are always text.

A chat template writes control tokens ("<|im_start|>system") around each message. Tokenizing the
rendered string as a whole would also turn a control token that a user *typed* into the real one,
letting them forge a system or assistant turn. So when a message holds such text, the template is
rendered with a unique marker in place of each content; the template's own text is tokenized with
its control tokens, and each content with `Tokenizer.encode_as_text`. Messages without such text
take the plain path, which gives exactly the ids of tokenizing the rendered prompt.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from rebar.model.chat_template import render_chat
from rebar.model.tokenizer import Tokenizer


def chat_prompt_ids(
    tokenizer: Tokenizer,
    template: str | None,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> list[int]:
    """The ids of `messages` (and `tools`) rendered by `template` (no BOS added: callers decide,
    as for any prompt)."""
    special = tokenizer.special
    contents = [message.get("content") for message in messages]
    if not any(isinstance(text, str) and tokenizer.holds_special_text(text) for text in contents):
        return tokenizer.encode(
            render_chat(
                template,
                messages,
                add_generation_prompt,
                special.bos_token,
                special.eos_token,
                tools,
            )
        )
    nonce = uuid.uuid4().hex  # cannot occur in the messages or the template by chance
    marked = [
        {**message, "content": f"[{nonce}:{i}]"}
        if isinstance(message.get("content"), str)
        else dict(message)
        for i, message in enumerate(messages)
    ]
    rendered = render_chat(
        template, marked, add_generation_prompt, special.bos_token, special.eos_token, tools
    )
    ids: list[int] = []
    # re.split with a group alternates template text and the index of the content at each marker.
    for position, piece in enumerate(re.split(rf"\[{nonce}:(\d+)\]", rendered)):
        if position % 2 == 0:
            ids += tokenizer.encode(piece) if piece else []
        else:
            content = contents[int(piece)]
            assert isinstance(content, str)  # only string contents were marked
            ids += tokenizer.encode_as_text(content)
    return ids
