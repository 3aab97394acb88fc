"""Attention for a run of prompt tokens, the pieces `attention_batched` puts together: causal
(optionally windowed) scaled-dot-product calls, with two schedules for long runs on the CPU.

- Key tiles (a layer without a window, past the first KEY_TILE positions): the keys split into
  tiles fixed at absolute positions; a query attends the whole tiles before its own in one
  mask-free flash-attention call and its own tile causally, merged through log-sum-exps. The split
  depends on the query's position alone, so however a prompt's chunks were cut (a prefix-cache hit
  included) it computes the same numbers from the same cached keys and values. (Those a fresh
  prompt writes depend in their last bits on its length: docs/kernels.md, "Prompt attention and
  the prefix cache".)
- Windowed blocks (a sliding-window layer): WINDOW_QUERY_BLOCK queries at a time over only the keys
  their window sees, each block's mask a slice of one additive mask per window.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


def window_start(first_query_pos: int, sliding_window: int | None) -> int:
    """First key position any query from `first_query_pos` on may see (keys > pos - window)."""
    if sliding_window is None:
        return 0
    return max(0, first_query_pos - sliding_window + 1)


# Keys past the first tile of this many positions go through key_tiles (the default step budget,
# so with it a chunk is one tile's queries, and a prompt within one tile takes the plain calls).
KEY_TILE = 2048

# SDPA's CPU flash-attention kernel, which also returns each query's log-sum-exp of scores (the
# public call computes the same outputs but keeps that to itself).
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def takes_key_tiles(q: torch.Tensor, context_len: int, sliding_window: int | None) -> bool:
    """Whether queries `q` of a context of `context_len` positions attend through key_tiles: a
    layer without a window, past the first tile, on the CPU (where the flash kernel returns its
    log-sum-exps)."""
    return (
        sliding_window is None
        and context_len > KEY_TILE
        and _FLASH_CPU is not None
        and q.device.type == "cpu"
    )


def key_tiles(
    q: torch.Tensor,  # [t, num_heads, head_dim]: queries at positions first_query ...
    keys: torch.Tensor,  # [first_query + t, num_kv_heads, head_dim]: every key from position 0
    values: torch.Tensor,
    first_query: int,
    scale: float,
) -> torch.Tensor:  # [t, num_heads, head_dim]
    """Causal attention without a window, the keys in tiles of KEY_TILE from position 0: the
    queries of each tile attend the whole tiles before it without a mask and their own causally,
    merged through log-sum-exps (no [t, context] mask built or applied, no scores of keys a query
    cannot see outside its own tile)."""
    assert _FLASH_CPU is not None  # takes_key_tiles
    out = torch.empty_like(q)
    begin = 0
    while begin < q.shape[0]:
        tile_start = (first_query + begin) // KEY_TILE * KEY_TILE
        end = min(q.shape[0], tile_start + KEY_TILE - first_query)
        queries = q[begin:end].transpose(0, 1)[None]  # [1, heads, n, d]
        last_key = first_query + end
        own_keys = keys[tile_start:last_key].transpose(0, 1)[None]
        own_values = values[tile_start:last_key].transpose(0, 1)[None]
        if first_query + begin == tile_start:  # the tile's first query on: a causal square
            own, own_lse = _FLASH_CPU(queries, own_keys, own_values, 0.0, True, scale=scale)
        else:
            allowed = causal_mask(
                torch.arange(first_query + begin, last_key, device=q.device),
                torch.arange(tile_start, last_key, device=q.device),
                None,
            )
            mask = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device)
            mask.masked_fill_(~allowed, float("-inf"))
            own, own_lse = _FLASH_CPU(
                queries, own_keys, own_values, 0.0, False, attn_mask=mask, scale=scale
            )
        if tile_start > 0:
            before, before_lse = _FLASH_CPU(
                queries,
                keys[:tile_start].transpose(0, 1)[None],
                values[:tile_start].transpose(0, 1)[None],
                0.0,
                False,
                scale=scale,
            )
            top = torch.maximum(before_lse, own_lse)
            before_weight, own_weight = (before_lse - top).exp_(), (own_lse - top).exp_()
            own = (before * before_weight[..., None] + own * own_weight[..., None]) / (
                before_weight + own_weight
            )[..., None]
        out[begin:end] = own[0].transpose(0, 1)
        begin = end
    return out


# A sliding-window layer attends a long run of queries in blocks of this many, each over only the
# keys its window can see. One call over a 2,048-token chunk would score every query against all
# 2,559 keys of the chunk and its window (Gemma 3's window is 512) and mask four in five away;
# blocks of 64 score 575 keys a query (blocks of 256: 767, and measured 16% slower).
WINDOW_QUERY_BLOCK = 64


def takes_windowed_blocks(query_len: int) -> bool:
    """Whether a run of `query_len` prompt queries under a sliding window attends through
    windowed_blocks (a shorter one takes a single masked call)."""
    return query_len > WINDOW_QUERY_BLOCK


def windowed_blocks(
    q: torch.Tensor,  # [t, num_heads, head_dim]: queries at positions first_query ...
    keys: torch.Tensor,  # [s, num_kv_heads, head_dim]: keys at positions key_start ...
    values: torch.Tensor,
    first_query: int,
    key_start: int,
    sliding_window: int,
    scale: float,
) -> torch.Tensor:  # [t, num_heads, head_dim]
    """Causal windowed attention, WINDOW_QUERY_BLOCK queries at a time over the keys they see.

    Every block's mask is a slice of one additive mask made once per window: a block whose window
    is whole (past the prompt's first positions) sees the same pattern of keys wherever it is."""
    out = torch.empty_like(q)
    mask = _window_mask(sliding_window, q.dtype, q.device)
    for begin in range(0, q.shape[0], WINDOW_QUERY_BLOCK):
        end = min(q.shape[0], begin + WINDOW_QUERY_BLOCK)
        block = first_query + begin  # the block's first position
        first_key = max(key_start, window_start(block, sliding_window))
        last_key = first_query + end  # exclusive: the block's last query sees itself
        column = first_key - (block - sliding_window + 1)  # past 0 where the window is clipped
        rows = mask[: end - begin, column : column + last_key - first_key]
        span = slice(first_key - key_start, last_key - key_start)
        out[begin:end] = sdpa(q[begin:end], keys[span], values[span], rows, scale)
    return out


@functools.lru_cache(maxsize=8)
def _window_mask(sliding_window: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[WINDOW_QUERY_BLOCK, sliding_window - 1 + WINDOW_QUERY_BLOCK] additive mask of a whole block:
    row r (the block's r-th position) against the keys from sliding_window - 1 positions before the
    block's first: 0 where the query sees the key (r <= column <= r + window - 1), else -inf."""
    rows = torch.arange(WINDOW_QUERY_BLOCK, device=device)[:, None]
    columns = torch.arange(sliding_window - 1 + WINDOW_QUERY_BLOCK, device=device)[None, :]
    allowed = (columns >= rows) & (columns <= rows + sliding_window - 1)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
    return mask.masked_fill_(~allowed, float("-inf"))


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
