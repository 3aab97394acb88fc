"""Attention over a paged KV cache: the torch reference implementation.

Tokens of every sequence in a step are flattened into one batch. Each sequence owns a list of
fixed-size KV blocks (its block table); a token's K/V are written at its slot
(`block * block_size + offset`), and its queries attend over the sequence's whole context,
gathered back from those blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from rebar.kernels import kv_quant


@dataclass(frozen=True)
class DecodeSlots:
    """Where a step's decode rows (one new token each, in sequence order) read their keys in a layer
    with a given sliding window: every layer with that window reads the same slots."""

    slots: torch.Tensor  # [num_decode_rows, width] int64, padded by repeating a row's last key
    valid: torch.Tensor | None  # [num_decode_rows, width] bool; None when no row is padded


@dataclass
class StepScratch:
    """Tensors derived from one step's metadata that the first layer builds and the others reuse.

    It is created with its AttentionMetadata and dropped with it, so it never outlives the step.
    """

    decode_slots: dict[int | None, DecodeSlots] = field(default_factory=dict)  # by sliding window


@dataclass(frozen=True)
class AttentionMetadata:
    """Plain description of one model step, built by the runner.

    query_lens[i] new tokens of sequence i sit contiguously in the flattened batch, in sequence
    order; after this step sequence i has context_lens[i] tokens in the cache (the new ones
    included, at the end).
    """

    query_lens: tuple[int, ...]
    context_lens: tuple[int, ...]
    slot_mapping: torch.Tensor  # [num_tokens] int64
    block_tables: (
        torch.Tensor
    )  # [num_seqs, max_blocks_per_seq] int64, padded with 0 past each sequence's blocks
    # Sequences whose one new token is a prompt's (attended as a prompt chunk, not a decode row);
    # a sequence with more new tokens is a prompt chunk anyway.
    prompt_rows: frozenset[int] = frozenset()
    # What backends derive from the fields above on a step's first layer (the only mutable part).
    scratch: StepScratch = field(default_factory=StepScratch, compare=False, repr=False)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)


def pad_block_tables(tables: list[list[int]], device: torch.device | str = "cpu") -> torch.Tensor:
    """[num_seqs, max_blocks] int64 from ragged per-sequence block lists (padding with block 0)."""
    width = max((len(t) for t in tables), default=0)
    padded = [t + [0] * (width - len(t)) for t in tables]
    return torch.tensor(padded, dtype=torch.long, device=device).reshape(len(tables), width)


class KVCache:
    """Preallocated K and V blocks for every layer: [num_blocks, block_size, num_kv_heads,
    head_dim] of a float dtype, or of Q8_0 rows when `dtype` is uint8 (`rebar.kernels.kv_quant`)."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (num_blocks, block_size, num_kv_heads, kv_quant.row_width(head_dim, dtype))
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.dtype = dtype
        # Uninitialised on purpose: attention only ever reads slots this sequence has written
        # (padding points at its own tokens and is masked), so zero-filling gigabytes at start buys
        # nothing.
        self.keys = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)


def write_kv(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """Store this step's K/V ([num_tokens, num_kv_heads, head_dim]) at their slots, in the cache's
    storage."""
    for cache, x in ((key_cache, k), (value_cache, v)):
        rows = cache.view(-1, cache.shape[2], cache.shape[3])
        rows.index_copy_(0, slots, kv_quant.to_storage(x, cache.dtype))


def as_stored(x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """x as attention reads it back from `cache`: rounded through the cache's storage when that is
    narrower. A fresh prompt attends over its own K/V without a cache read, and must see what a
    later chunk or decode step will, or its output would depend on how it was chunked."""
    if x.dtype == cache.dtype:
        return x
    return kv_quant.from_storage(kv_quant.to_storage(x, cache.dtype), x.dtype)


def _gather(
    cache: torch.Tensor, block_table: torch.Tensor, length: int, dtype: torch.dtype
) -> torch.Tensor:
    # [num_blocks_used, block_size, h, row] -> [length, h, d] in `dtype`
    num_blocks = -(-length // cache.shape[1])
    blocks = cache.index_select(0, block_table[:num_blocks])
    return kv_quant.from_storage(blocks.reshape(-1, cache.shape[2], cache.shape[3])[:length], dtype)


def _causal_mask(
    query_len: int, context_len: int, sliding_window: int | None, device: torch.device
) -> torch.Tensor:
    """[query_len, context_len] bool, True where a query may attend to a key."""
    query_pos = torch.arange(context_len - query_len, context_len, device=device)[:, None]
    key_pos = torch.arange(context_len, device=device)[None, :]
    allowed = key_pos <= query_pos
    if sliding_window is not None:
        allowed &= key_pos > query_pos - sliding_window
    return allowed


def paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Write K/V to the cache, then causal (optionally windowed) attention per sequence via SDPA."""
    write_kv(key_cache, value_cache, k, v, meta.slot_mapping)
    out = torch.empty_like(q)
    start = 0
    for query_len, context_len, block_table in zip(
        meta.query_lens, meta.context_lens, meta.block_tables
    ):
        end = start + query_len
        if context_len == query_len:  # nothing cached before: attend over this step's own K/V
            keys, values = as_stored(k[start:end], key_cache), as_stored(v[start:end], value_cache)
        else:
            keys = _gather(key_cache, block_table, context_len, q.dtype)
            values = _gather(value_cache, block_table, context_len, q.dtype)
        mask = None
        if query_len > 1 or (sliding_window is not None and context_len > sliding_window):
            mask = _causal_mask(query_len, context_len, sliding_window, q.device)
        attended = F.scaled_dot_product_attention(
            q[start:end].transpose(0, 1),  # [heads, q, d]
            keys.transpose(0, 1),
            values.transpose(0, 1),
            attn_mask=mask,
            scale=scale,
            enable_gqa=True,
        )
        out[start:end] = attended.transpose(0, 1)
        start = end
    return out
