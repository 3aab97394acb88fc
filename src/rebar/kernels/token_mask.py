"""Apply token bitmasks to logits: the tokens a grammar forbids get -inf.

A bitmask row holds one bit per token (bit i % 32 of int32 word i / 32, set = allowed), the layout
grammar libraries fill. The compiled path (csrc/elementwise.cpp `mask_logits`) skips all-allowed
words and fills all-forbidden ones at once, in one pass over the row; the torch reference unpacks
the bits first (tens of times slower at a 262k vocabulary). Like `cpu_elementwise`, nothing here
builds the extension: it is used once this process has loaded it.
"""

from __future__ import annotations

import torch

from rebar.kernels.cpu_quant.build import loaded_extension


def bitmask_words(vocab_size: int) -> int:
    """Int32 words per bitmask row for `vocab_size` tokens."""
    return (vocab_size + 31) // 32


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> list[int]:
    """In place: logits[rows[j], i] = -inf wherever bit i of bitmask[j] is clear; returns how many
    tokens each of `rows` still allows.

    `logits` is [batch, vocab] float32, `bitmask` [len(rows), >= bitmask_words(vocab)] int32.
    """
    if not rows:
        return []
    extension = loaded_extension()
    if (
        extension is not None
        and logits.dtype == torch.float32
        and logits.device.type == "cpu"
        and logits.is_contiguous()
    ):
        return extension.mask_logits_(
            logits, bitmask, torch.tensor(rows, dtype=torch.long)
        ).tolist()
    return reference_apply_token_bitmask_(logits, bitmask, rows)


_BITS = torch.tensor([1 << b for b in range(31)] + [-(1 << 31)], dtype=torch.int32)


def reference_apply_token_bitmask_(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]
) -> list[int]:
    """The same in torch, on any device."""
    vocab = logits.shape[1]
    words = bitmask_words(vocab)
    if bitmask.shape[1] < words:
        raise ValueError(f"bitmask has {bitmask.shape[1]} words for {vocab} logits")
    packed = bitmask[:, :words].to(logits.device)
    allowed = (packed.unsqueeze(-1) & _BITS.to(logits.device)) != 0
    allowed = allowed.reshape(len(rows), -1)[:, :vocab]
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
    return allowed.sum(-1).tolist()
