"""Paged attention with the decode rows of a step batched into one SDPA call.

Same contract as the reference `rebar.kernels.attention.paged_attention`, different schedule:

- decode rows (one new token each) gather all their keys/values with one `index_select` per
  cache into a padded [num_decode, max_context, kv_heads, head_dim] batch and run ONE
  `scaled_dot_product_attention` call with a key-padding mask (only the last `sliding_window`
  positions are gathered when a window is set);
- a run of prompt tokens attends through `prompt_attention`: over its own K/V when nothing is
  cached (no gather), else over the (windowed) context gathered from the cache, in calls whose
  shapes depend on each query's absolute position alone, so that a query gets the same bits however
  its prompt was cut into chunks and whatever the prompt's length (a prefix-cache hit computes what
  the whole prompt would cold).

Padding never reads unused cache memory: every padded key position is redirected to a real token
of the same sequence (then masked out), because a masked position still multiplies its value by
zero, and NaN or inf left in a free block would turn that product into NaN.

GQA without copying K/V: for a one-token query all query heads of a group share the same keys, so
the group is folded into the query-length axis ([n, kv_heads, group, head_dim]). On CPU this
measured as fast as `enable_gqa=True` and about 4x faster than repeating kv heads, and it asks
no GQA support of whichever fused kernel SDPA picks. Nothing here requires CUDA; on a GPU the
same calls dispatch to SDPA's fused kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rebar.kernels import kv_quant
from rebar.kernels.attention import AttentionMetadata, DecodeSlots, as_stored, write_kv
from rebar.kernels.prompt_attention import prompt_attention, window_start


def batched_paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Write K/V to the cache, then causal (optionally windowed) attention for every sequence.

    Agrees with the reference backend to floating-point round-off; reads only cache slots that
    belong to a sequence's context.
    """
    write_kv(key_cache, value_cache, k, v, meta.slot_mapping)
    if not meta.query_lens:
        return torch.empty_like(q)
    starts = _token_starts(meta.query_lens)
    decode_seqs = [i for i, n in enumerate(meta.query_lens) if n == 1 and i not in meta.prompt_rows]
    if len(decode_seqs) == len(meta.query_lens):  # pure decode step: the whole batch in one call
        return _decode(q, key_cache, value_cache, meta, decode_seqs, scale, sliding_window)

    out = torch.empty_like(q)
    if decode_seqs:
        rows = torch.tensor([starts[i] for i in decode_seqs], dtype=torch.long, device=q.device)
        decoded = _decode(
            q.index_select(0, rows),
            key_cache,
            value_cache,
            meta,
            decode_seqs,
            scale,
            sliding_window,
        )
        out.index_copy_(0, rows, decoded)
    decode_rows = set(decode_seqs)
    for seq, (query_len, context_len) in enumerate(zip(meta.query_lens, meta.context_lens)):
        if seq in decode_rows:
            continue
        span = slice(starts[seq], starts[seq] + query_len)
        if context_len == query_len:
            keys, values = as_stored(k[span], key_cache), as_stored(v[span], value_cache)
            out[span] = _fresh_prefill(q[span], keys, values, scale, sliding_window)
        else:
            table = meta.block_tables[seq]
            out[span] = _chunk_prefill(
                q[span], key_cache, value_cache, table, context_len, scale, sliding_window
            )
    return out


def _token_starts(query_lens: tuple[int, ...]) -> list[int]:
    starts, total = [], 0
    for n in query_lens:
        starts.append(total)
        total += n
    return starts


def _context_slots(
    block_tables: torch.Tensor,  # [n, max_blocks] int64
    block_size: int,
    key_starts: torch.Tensor,  # [n] int64: first key position gathered per row
    key_counts: torch.Tensor,  # [n] int64: real keys per row (>= 1)
    width: int,  # padded number of keys per row (>= max key_counts)
) -> tuple[torch.Tensor, torch.Tensor]:  # slots [n, width] int64, valid [n, width] bool
    """Cache slots of each row's keys, padded to `width` by repeating the row's last real key."""
    offsets = torch.arange(width, device=block_tables.device)[None, :]
    valid = offsets < key_counts[:, None]
    positions = key_starts[:, None] + torch.minimum(offsets, key_counts[:, None] - 1)
    blocks = block_tables.gather(1, torch.div(positions, block_size, rounding_mode="floor"))
    return blocks * block_size + positions % block_size, valid


def _gather_kv(
    key_cache: torch.Tensor,  # [num_blocks, block_size, h, row]
    value_cache: torch.Tensor,
    slots: torch.Tensor,  # [*shape] int64
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:  # keys, values: [*shape, h, d] in `dtype`
    """Copy the keys and values at `slots` out of the cache, as values in `dtype`.

    Both land in one allocation: with two separate multi-megabyte buffers freed after every layer,
    glibc's malloc was seen returning the memory to the OS and page-faulting it back in on the
    next call (a 15x slower gather in a decode micro-benchmark). `index_select` is a plain row
    copy, about 5x faster on CPU than advanced indexing.
    """
    num_heads, width = key_cache.shape[2], key_cache.shape[3]
    index = slots.reshape(-1)
    out = torch.empty(
        2, index.numel(), num_heads, width, dtype=key_cache.dtype, device=key_cache.device
    )
    torch.index_select(key_cache.view(-1, num_heads, width), 0, index, out=out[0])
    torch.index_select(value_cache.view(-1, num_heads, width), 0, index, out=out[1])
    # a float16 or Q8_0 cache computes in q's dtype
    out = kv_quant.from_storage(out.view(2, *slots.shape, num_heads, width), dtype)
    return out[0], out[1]


def _decode(
    q: torch.Tensor,  # [n, num_heads, head_dim]: one query per decode sequence
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    seqs: list[int],  # which sequences of `meta` these rows are
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:  # [n, num_heads, head_dim]
    """One SDPA call over every decode row, keys padded to the longest (windowed) context."""
    decode_slots = _decode_slots(meta, seqs, key_cache.shape[1], sliding_window, q.device)
    slots, valid = decode_slots.slots, decode_slots.valid
    keys, values = _gather_kv(
        key_cache, value_cache, slots, q.dtype
    )  # [n, width, kv_heads, head_dim]
    keys, values = keys.transpose(1, 2), values.transpose(1, 2)  # [n, kv_heads, width, head_dim]
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = keys.shape[1]
    # Fold each GQA group into the query axis: [n, kv_heads, group, head_dim].
    grouped = q.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    mask = None if valid is None else valid[:, None, None, :]
    out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask, scale=scale)
    return out.reshape(num_seqs, num_heads, head_dim)


def _decode_slots(
    meta: AttentionMetadata,
    seqs: list[int],
    block_size: int,
    sliding_window: int | None,
    device: torch.device,
) -> DecodeSlots:
    """The decode rows' cache slots, computed by the first layer of a step with this window and
    reused by the others (`seqs` are always the step's decode rows, and one cache has one block
    size, so the window tells the layers apart).

    `valid` is None when no row is padded (every row has `width` keys): SDPA then needs no mask.
    """
    cached = meta.scratch.decode_slots.get(sliding_window)
    if cached is not None:
        return cached
    context_lens = [meta.context_lens[i] for i in seqs]
    key_starts = [window_start(c - 1, sliding_window) for c in context_lens]
    key_counts = [c - s for c, s in zip(context_lens, key_starts)]
    num_blocks = -(-(max(context_lens)) // block_size)
    tables = meta.block_tables[:, :num_blocks]
    if len(seqs) != tables.shape[0]:
        tables = tables.index_select(0, torch.tensor(seqs, dtype=torch.long, device=device))
    slots, valid = _context_slots(
        tables,
        block_size,
        torch.tensor(key_starts, dtype=torch.long, device=device),
        torch.tensor(key_counts, dtype=torch.long, device=device),
        max(key_counts),
    )
    result = DecodeSlots(slots, None if min(key_counts) == max(key_counts) else valid)
    meta.scratch.decode_slots[sliding_window] = result
    return result


def _fresh_prefill(
    q: torch.Tensor,  # [t, num_heads, head_dim]
    k: torch.Tensor,  # [t, num_kv_heads, head_dim]
    v: torch.Tensor,  # [t, num_kv_heads, head_dim]
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:  # [t, num_heads, head_dim]
    """A prompt with nothing cached: attend over its own K/V, no cache read at all."""
    return prompt_attention(q, k, v, 0, 0, scale, sliding_window)


def _chunk_prefill(
    q: torch.Tensor,  # [t, num_heads, head_dim]: the last t tokens of a context_len-token sequence
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,  # [max_blocks] int64
    context_len: int,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:  # [t, num_heads, head_dim]
    """A chunk continuing a cached context: gather the (windowed) context, then attend as the
    whole prompt would have."""
    first_query = context_len - q.shape[0]
    key_start = window_start(first_query, sliding_window)
    key_count = context_len - key_start
    slots, _ = _context_slots(
        block_table[None, :],
        key_cache.shape[1],
        torch.tensor([key_start], dtype=torch.long, device=q.device),
        torch.tensor([key_count], dtype=torch.long, device=q.device),
        key_count,
    )
    keys, values = _gather_kv(
        key_cache, value_cache, slots[0], q.dtype
    )  # [key_count, kv_heads, head_dim]
    return prompt_attention(q, keys, values, first_query, key_start, scale, sliding_window)
