"""Attention for a run of prompt tokens, the piece `attention_batched` calls for prefills and
chunks: causal (optionally windowed) scaled-dot-product calls whose shapes depend on each query's
absolute position alone.

torch's CPU flash-attention kernel blocks its work by the shapes it is given (how many keys, where
the causal diagonal cuts them), so the same query over the same keys can get other last bits in a
call of another shape. A prompt cut into other chunks, or a prefix-cache hit that reuses the keys a
prompt of another length wrote, would then compute other numbers than the whole prompt cold; on an
8-bit quantized path such a difference can move a rounding step, and a greedy token with it. Here a
query is always computed in the same call shape, whatever else the call holds:

- Layers without a window: queries in blocks of QUERY_BLOCK at absolute positions. A block attends
  the keys of its own tile of KEY_TILE positions up to the block's end (keys not written yet padded
  with zeros) under one fixed causal mask; past the first tile its queries also attend the whole
  tiles before theirs in one mask-free call, merged through log-sum-exps (no [t, context] mask, and
  no scores of keys a query cannot see outside its own tile).
- Sliding-window layers: blocks of WINDOW_QUERY_BLOCK at absolute positions, each over the keys its
  window sees up to the block's end, padded likewise, under a slice of one mask per window.

A call's queries may be any run of its block's: the kernel computes each query's row alone, so its
bits do not depend on how many others share the call (tests/kernels/test_attention.py). Padding
keys are masked, and zero so that a masked score times its value stays 0. Without the CPU kernel
(another device) a run of queries takes one causal call.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

# Queries of a layer without a window attend in blocks of this many at absolute positions. A
# block's own-tile call also scores the keys past each query in its diagonal block (on average
# half a block: an eighth more arithmetic than a causal call over a 2,048-token prompt). Per layer
# on SmolLM2's shapes, 256 against 128 and 512: 33.8 against 38.0 and 40.3 ms at 2,048 positions,
# 2.8 against 2.8 and 3.9 at 512 (one causal call: 29.8 and 3.1; docs/kernels.md).
QUERY_BLOCK = 256
# Keys past the first tile of this many positions are attended as whole tiles before a query's own
# (a multiple of QUERY_BLOCK).
KEY_TILE = 2048
# A sliding-window layer's queries attend in blocks of this many, each over only the keys its
# window can see: a 2,048-token chunk in one call would score every query against all 2,559 keys
# of the chunk and its window (Gemma 3's window is 512) and mask four in five away; blocks of 64
# score 575 keys a query (blocks of 256: 767, and measured 16% slower).
WINDOW_QUERY_BLOCK = 64

# Calls take queries in multiples of this many. The kernel splits a call's queries into runs of 32
# or more and multiplies each run by the keys in one matrix product; a run of a few queries at the
# end takes other product kernels, whose last bits differ (measured with head_dim 16: a last run of
# 1 query; 64: of 1 or 2; 256: of up to 10).
QUERY_ROWS = 32

# SDPA's CPU flash-attention kernel, which also returns each query's log-sum-exp of scores (the
# public call computes the same outputs but keeps that to itself).
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def window_start(first_query_pos: int, sliding_window: int | None) -> int:
    """First key position any query from `first_query_pos` on may see (keys > pos - window)."""
    if sliding_window is None:
        return 0
    return max(0, first_query_pos - sliding_window + 1)


def prompt_attention(
    q: torch.Tensor,  # [t, num_heads, head_dim]: queries at positions first_query ...
    keys: torch.Tensor,  # [first_query + t - key_start, num_kv_heads, head_dim]: from key_start
    values: torch.Tensor,
    first_query: int,
    key_start: int,  # at most window_start(first_query, sliding_window)
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:  # [t, num_heads, head_dim]
    """Causal (optionally windowed) attention of a run of prompt queries over the keys before
    them, each query's bits fixed by its position (see the module docstring)."""
    if _FLASH_CPU is None or q.device.type != "cpu":
        return _one_call(q, keys, values, first_query, key_start, scale, sliding_window)
    if sliding_window is None:
        assert key_start == 0, "a layer without a window sees every key"
        return _global_blocks(q, keys, values, first_query, scale)
    return _window_blocks(q, keys, values, first_query, key_start, sliding_window, scale)


def _global_blocks(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, first_query: int, scale: float
) -> torch.Tensor:
    assert KEY_TILE % QUERY_BLOCK == 0, "a block's keys start where its tile does"
    out = torch.empty_like(q)
    end = first_query + q.shape[0]
    begin = first_query
    while begin < end:
        tile = begin // KEY_TILE * KEY_TILE
        tile_stop = min(end, tile + KEY_TILE)
        # The tiles before this one, for every query of the run in this tile at once.
        before = None
        if tile > 0:
            before = _flash(
                q[begin - first_query : tile_stop - first_query], keys[:tile], values[:tile], scale
            )
        block_begin = begin
        while block_begin < tile_stop:
            block = block_begin // QUERY_BLOCK * QUERY_BLOCK
            stop = min(tile_stop, block + QUERY_BLOCK)
            own_keys = _key_span(keys, 0, tile, block + QUERY_BLOCK)
            own_values = _key_span(values, 0, tile, block + QUERY_BLOCK)
            mask = _causal_block_mask(block - tile, QUERY_BLOCK, q.dtype, q.device)[
                block_begin - block : stop - block
            ]
            rows = slice(block_begin - first_query, stop - first_query)
            own, own_lse = _flash(q[rows], own_keys, own_values, scale, mask)
            if before is not None:
                part = slice(block_begin - begin, stop - begin)
                own = _merge(before[0][..., part, :], before[1][..., part], own, own_lse)
            out[rows] = own[0].transpose(0, 1)
            block_begin = stop
        begin = tile_stop
    return out


def _window_blocks(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    first_query: int,
    key_start: int,
    sliding_window: int,
    scale: float,
) -> torch.Tensor:
    out = torch.empty_like(q)
    mask = _window_mask(sliding_window, WINDOW_QUERY_BLOCK, q.dtype, q.device)
    end = first_query + q.shape[0]
    begin = first_query
    while begin < end:
        block = begin // WINDOW_QUERY_BLOCK * WINDOW_QUERY_BLOCK
        stop = min(end, block + WINDOW_QUERY_BLOCK)
        first_key = window_start(block, sliding_window)
        column = first_key - (block - sliding_window + 1)  # past 0 where the window is clipped
        width = block + WINDOW_QUERY_BLOCK - first_key
        rows = slice(begin - first_query, stop - first_query)
        out[rows] = _flash(
            q[rows],
            _key_span(keys, key_start, first_key, block + WINDOW_QUERY_BLOCK),
            _key_span(values, key_start, first_key, block + WINDOW_QUERY_BLOCK),
            scale,
            mask[begin - block : stop - block, column : column + width],
        )[0][0].transpose(0, 1)
        begin = stop
    return out


def _flash(
    q: torch.Tensor,  # [n, heads, d]
    keys: torch.Tensor,  # [s, kv_heads, d]
    values: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None = None,  # [n, s] additive
) -> tuple[torch.Tensor, torch.Tensor]:  # out [1, heads, n, d], log-sum-exp [1, heads, n]
    assert _FLASH_CPU is not None  # prompt_attention
    count = q.shape[0]
    padded = -(-count // QUERY_ROWS) * QUERY_ROWS
    if padded != count:  # copies of the last query (and its mask row), dropped after
        q = torch.cat([q, q[-1:].expand(padded - count, *q.shape[1:])])
        if mask is not None:
            mask = torch.cat([mask, mask[-1:].expand(padded - count, -1)])
    out, lse = _FLASH_CPU(
        q.transpose(0, 1)[None],  # the kernel serves each KV head's group of query heads (GQA)
        keys.transpose(0, 1)[None],
        values.transpose(0, 1)[None],
        0.0,
        False,
        attn_mask=mask,
        scale=scale,
    )[:2]
    return out[..., :count, :], lse[..., :count]


def _merge(
    before: torch.Tensor, before_lse: torch.Tensor, own: torch.Tensor, own_lse: torch.Tensor
) -> torch.Tensor:
    """Two softmax attentions over disjoint keys as one: each weighted by its share of the mass."""
    top = torch.maximum(before_lse, own_lse)
    before_weight, own_weight = (before_lse - top).exp_(), (own_lse - top).exp_()
    return (before * before_weight[..., None] + own * own_weight[..., None]) / (
        before_weight + own_weight
    )[..., None]


def _key_span(keys: torch.Tensor, key_start: int, low: int, high: int) -> torch.Tensor:
    """Keys at positions [low, high) from `keys` (positions key_start ...), zeros where it has
    none: a view when it has them all."""
    have_low, have_high = max(low, key_start), min(high, key_start + keys.shape[0])
    inside = keys[have_low - key_start : have_high - key_start]
    if have_low == low and have_high == high:
        return inside
    span = keys.new_zeros(high - low, *keys.shape[1:])
    span[have_low - low : have_high - low] = inside
    return span


@functools.lru_cache(maxsize=16)
def _causal_block_mask(
    offset: int, size: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """[size, offset + size] additive mask of a whole block of `size` queries whose first sits
    `offset` positions after the first key: row r sees columns up to offset + r."""
    rows = torch.arange(size, device=device)[:, None]
    columns = torch.arange(offset + size, device=device)[None, :]
    mask = torch.zeros(rows.shape[0], columns.shape[1], dtype=dtype, device=device)
    return mask.masked_fill_(columns > rows + offset, float("-inf"))


@functools.lru_cache(maxsize=8)
def _window_mask(
    sliding_window: int, size: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """[size, sliding_window - 1 + size] additive mask of a whole block of `size` queries: row r
    (the block's r-th position) against the keys from sliding_window - 1 positions before the
    block's first: 0 where the query sees the key (r <= column <= r + window - 1), else -inf."""
    rows = torch.arange(size, device=device)[:, None]
    columns = torch.arange(sliding_window - 1 + size, device=device)[None, :]
    allowed = (columns >= rows) & (columns <= rows + sliding_window - 1)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
    return mask.masked_fill_(~allowed, float("-inf"))


def _one_call(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    first_query: int,
    key_start: int,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """The whole run in one SDPA call (devices without the CPU kernel)."""
    end = first_query + q.shape[0]
    mask = None  # a fresh prompt that no window cuts: plain causal
    if first_query > 0 or (sliding_window is not None and end > sliding_window):
        mask = causal_mask(
            torch.arange(first_query, end, device=q.device),
            torch.arange(key_start, end, device=q.device),
            sliding_window,
        )
    return sdpa(q, keys, values, mask, scale)


def causal_mask(
    query_pos: torch.Tensor, key_pos: torch.Tensor, sliding_window: int | None
) -> torch.Tensor:
    """[len(query_pos), len(key_pos)] bool, True where the query may attend to the key."""
    allowed = key_pos[None, :] <= query_pos[:, None]
    if sliding_window is not None:
        allowed &= key_pos[None, :] > query_pos[:, None] - sliding_window
    return allowed


def sdpa(
    q: torch.Tensor,  # [t, num_heads, head_dim]
    keys: torch.Tensor,  # [s, num_kv_heads, head_dim]
    values: torch.Tensor,  # [s, num_kv_heads, head_dim]
    mask: torch.Tensor | None,  # [t, s] bool or additive float; None: plain causal, t == s
    scale: float,
) -> torch.Tensor:  # [t, num_heads, head_dim]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],  # [1, heads, t, d]: the 4-D form takes SDPA's fused CPU kernel
        keys.transpose(0, 1)[None],
        values.transpose(0, 1)[None],
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1)
