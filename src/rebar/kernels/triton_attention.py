"""Paged attention for decode steps as a Triton kernel: the GPU fast path.

A pure decode step (one new token per sequence) runs in two launches, FlashDecoding style:

1. `_decode_partition_kernel`, one program per (sequence, kv head, partition). A partition is a
   run of consecutive KV blocks of the sequence's (windowed) context. The program walks its
   blocks through the block table, scores all query heads of its GQA group against each block
   (the block's keys are loaded once for the whole group), and keeps an online softmax in fp32:
   running max, running sum of exponentials and an unnormalised output.
2. `_combine_partitions_kernel`, one program per (sequence, query head), rescales the
   partitions' results to a common max and normalises. With a single partition the first
   kernel normalises and writes the output itself, and this launch is skipped.

Splitting the context keeps the GPU busy when there are few sequences with long contexts.
Loads outside a sequence's context are masked, so free blocks, block-table padding and the tail
of a partly filled block are never read (they may hold NaN).

A Q8_0 cache (`rebar.kernels.kv_quant`, a uint8 tensor of 34-byte blocks) is read in place: each
block's float16 scale times its int8 codes.

Steps with any query longer than one token (prefill, chunked prefill) go to the torch backend
`batched_paged_attention` unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from rebar.kernels import kv_quant
from rebar.kernels.attention import AttentionMetadata, write_kv
from rebar.kernels.attention_batched import batched_paged_attention

# Tokens per partition: long enough that a partition's fixed cost is small, short enough that a
# few long sequences still spread over many programs.
DEFAULT_TOKENS_PER_PARTITION = 512


def triton_paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Write K/V to the cache, then attention; agrees with the reference to round-off.

    Pure decode steps run the Triton kernels (tensors must be on a GPU, or Triton must run its
    interpreter); steps that contain a prefill or a prompt chunk are delegated whole to the torch
    backend `batched_paged_attention`.
    """
    if any(n != 1 for n in meta.query_lens):
        return batched_paged_attention(q, k, v, key_cache, value_cache, meta, scale, sliding_window)
    write_kv(key_cache, value_cache, k, v, meta.slot_mapping)
    if not meta.query_lens:
        return torch.empty_like(q)
    tables, lens = meta.block_tables, meta.context_lens
    return paged_decode_attention(q, key_cache, value_cache, tables, lens, scale, sliding_window)


def paged_decode_attention(
    q: torch.Tensor,  # [num_seqs, num_heads, head_dim]: one query token per sequence
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int: physical block of each logical block
    context_lens: Sequence[int],  # tokens in the cache per sequence, this step's included (>= 1)
    scale: float,
    sliding_window: int | None = None,
    tokens_per_partition: int = DEFAULT_TOKENS_PER_PARTITION,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    """Attention of each sequence's last token over its cached context (already written)."""
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    assert key_cache.shape[3] == kv_quant.row_width(head_dim, key_cache.dtype)
    assert num_heads % num_kv_heads == 0, "query heads must be a multiple of kv heads"
    assert len(context_lens) == num_seqs and min(context_lens) >= 1
    group_size = num_heads // num_kv_heads
    blocks_per_partition = max(1, tokens_per_partition // block_size)
    num_partitions = max(
        -(-_num_window_blocks(n, block_size, sliding_window) // blocks_per_partition)
        for n in context_lens
    )
    out = torch.empty_like(q)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=q.device)
    single = num_partitions == 1
    # Per (sequence, query head, partition): running max, sum of exponentials, unnormalised output.
    stats_shape = (num_seqs, num_heads, num_partitions)
    partial_max = torch.empty(
        stats_shape if not single else (1, 1, 1), dtype=torch.float32, device=q.device
    )
    partial_sum = torch.empty_like(partial_max)
    partial_out = torch.empty((*partial_max.shape, head_dim), dtype=torch.float32, device=q.device)

    _decode_partition_kernel[(num_seqs, num_kv_heads, num_partitions)](
        q, key_cache, value_cache, block_tables, lens, out, partial_max, partial_sum, partial_out,
        scale, sliding_window or 0, num_heads, num_partitions,
        q.stride(0), q.stride(1), q.stride(2),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), key_cache.stride(3),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2), value_cache.stride(3),
        block_tables.stride(0), block_tables.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        HAS_WINDOW=sliding_window is not None,
        SINGLE_PARTITION=single,
        BLOCKS_PER_PARTITION=blocks_per_partition,
        BLOCK_SIZE=block_size,
        PADDED_BLOCK_SIZE=triton.next_power_of_2(block_size),
        HEAD_DIM=head_dim,
        PADDED_HEAD_DIM=triton.next_power_of_2(head_dim),
        GROUP_SIZE=group_size,
        PADDED_GROUP_SIZE=triton.next_power_of_2(group_size),
        Q8_0=kv_quant.is_quantized(key_cache.dtype),
    )  # fmt: skip
    if not single:
        _combine_partitions_kernel[(num_seqs, num_heads)](
            partial_max, partial_sum, partial_out, out, num_partitions,
            out.stride(0), out.stride(1), out.stride(2),
            HEAD_DIM=head_dim,
            PADDED_HEAD_DIM=triton.next_power_of_2(head_dim),
            PADDED_NUM_PARTITIONS=triton.next_power_of_2(num_partitions),
        )  # fmt: skip
    return out


def _num_window_blocks(context_len: int, block_size: int, sliding_window: int | None) -> int:
    """Blocks from the one holding the first visible key to the last one."""
    first_key = 0 if sliding_window is None else max(0, context_len - sliding_window)
    return -(-context_len // block_size) - first_key // block_size


@triton.jit
def _decode_partition_kernel(
    q_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr, context_lens_ptr, out_ptr,
    partial_max_ptr, partial_sum_ptr, partial_out_ptr,
    scale, sliding_window, num_heads, num_partitions,
    stride_q_seq, stride_q_head, stride_q_dim,
    stride_k_block, stride_k_slot, stride_k_head, stride_k_dim,
    stride_v_block, stride_v_slot, stride_v_head, stride_v_dim,
    stride_table_seq, stride_table_block,
    stride_out_seq, stride_out_head, stride_out_dim,
    HAS_WINDOW: tl.constexpr,
    SINGLE_PARTITION: tl.constexpr,
    BLOCKS_PER_PARTITION: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    PADDED_BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PADDED_HEAD_DIM: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    PADDED_GROUP_SIZE: tl.constexpr,
    Q8_0: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    partition = tl.program_id(2)

    context_len = tl.load(context_lens_ptr + seq)
    first_key = 0
    if HAS_WINDOW:
        first_key = tl.maximum(context_len - sliding_window, 0)  # keys > query_pos - window
    first_block = first_key // BLOCK_SIZE + partition * BLOCKS_PER_PARTITION
    end_block = tl.minimum(first_block + BLOCKS_PER_PARTITION, tl.cdiv(context_len, BLOCK_SIZE))

    group = tl.arange(0, PADDED_GROUP_SIZE)  # query heads of this kv head
    heads = kv_head * GROUP_SIZE + group
    group_mask = group < GROUP_SIZE
    dims = tl.arange(0, PADDED_HEAD_DIM)
    dim_mask = dims < HEAD_DIM
    slots = tl.arange(0, PADDED_BLOCK_SIZE)

    q_ptrs = (
        q_ptr + seq * stride_q_seq + heads[:, None] * stride_q_head + dims[None, :] * stride_q_dim
    )
    q = tl.load(q_ptrs, mask=group_mask[:, None] & dim_mask[None, :], other=0.0).to(tl.float32)
    q = q * scale  # [group, dim]

    running_max = tl.full([PADDED_GROUP_SIZE], float("-inf"), dtype=tl.float32)
    running_sum = tl.zeros([PADDED_GROUP_SIZE], dtype=tl.float32)
    acc = tl.zeros([PADDED_GROUP_SIZE, PADDED_HEAD_DIM], dtype=tl.float32)
    # Every block visited holds at least one visible key, so the running max is finite after the
    # first one and `exp(old_max - new_max)` never sees -inf - -inf.
    for logical_block in range(first_block, end_block):
        physical_block = tl.load(
            block_tables_ptr + seq * stride_table_seq + logical_block * stride_table_block
        )
        physical_block = physical_block.to(
            tl.int64
        )  # block * stride can pass 2^31 in a large cache
        positions = logical_block * BLOCK_SIZE + slots
        visible = (slots < BLOCK_SIZE) & (positions < context_len) & (positions >= first_key)
        kv_mask = visible[:, None] & dim_mask[None, :]

        k_rows = (
            key_cache_ptr + physical_block * stride_k_block + slots[:, None] * stride_k_slot
            + kv_head * stride_k_head
        )  # fmt: skip
        keys = _load_rows(k_rows, dims[None, :], stride_k_dim, kv_mask, Q8_0)  # [slot, dim]
        scores = tl.sum(q[:, None, :] * keys[None, :, :], axis=2)  # [group, slot]
        scores = tl.where(visible[None, :], scores, float("-inf"))

        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        rescale = tl.exp(running_max - new_max)
        weights = tl.exp(scores - new_max[:, None])
        running_sum = running_sum * rescale + tl.sum(weights, axis=1)

        v_rows = (
            value_cache_ptr + physical_block * stride_v_block + slots[:, None] * stride_v_slot
            + kv_head * stride_v_head
        )  # fmt: skip
        values = _load_rows(v_rows, dims[None, :], stride_v_dim, kv_mask, Q8_0)  # [slot, dim]
        acc = acc * rescale[:, None] + tl.sum(weights[:, :, None] * values[None, :, :], axis=1)
        running_max = new_max

    out_mask = group_mask[:, None] & dim_mask[None, :]
    if SINGLE_PARTITION:
        out_ptrs = (
            out_ptr
            + seq * stride_out_seq
            + heads[:, None] * stride_out_head
            + dims[None, :] * stride_out_dim
        )
        result = acc / running_sum[:, None]
        tl.store(out_ptrs, result.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # Partials are contiguous: [num_seqs, num_heads, num_partitions] and [..., HEAD_DIM].
        stat_index = (seq * num_heads + heads) * num_partitions + partition
        tl.store(partial_max_ptr + stat_index, running_max, mask=group_mask)
        tl.store(partial_sum_ptr + stat_index, running_sum, mask=group_mask)
        tl.store(
            partial_out_ptr + stat_index[:, None] * HEAD_DIM + dims[None, :], acc, mask=out_mask
        )


@triton.jit
def _load_rows(rows, dims, stride_dim, mask, Q8_0: tl.constexpr):
    """Values [slot, dim] in float32 of the cache rows starting at `rows` ([slot, 1] pointers)."""
    if Q8_0:  # 34-byte blocks: a float16 scale, then 32 int8 codes
        block = rows + (dims // 32) * 34
        codes = tl.load(block + 2 + dims % 32, mask=mask, other=0).to(tl.int8, bitcast=True)
        scales = tl.load(block.to(tl.pointer_type(tl.float16)), mask=mask, other=0.0)
        return codes.to(tl.float32) * scales.to(tl.float32)
    return tl.load(rows + dims * stride_dim, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _combine_partitions_kernel(
    partial_max_ptr, partial_sum_ptr, partial_out_ptr, out_ptr, num_partitions,
    stride_out_seq, stride_out_head, stride_out_dim,
    HEAD_DIM: tl.constexpr,
    PADDED_HEAD_DIM: tl.constexpr,
    PADDED_NUM_PARTITIONS: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    head = tl.program_id(1)
    num_heads = tl.num_programs(1)

    partitions = tl.arange(0, PADDED_NUM_PARTITIONS)
    partition_mask = partitions < num_partitions
    dims = tl.arange(0, PADDED_HEAD_DIM)
    dim_mask = dims < HEAD_DIM
    stat_index = (seq * num_heads + head) * num_partitions + partitions

    # A partition past the end of a shorter sequence saw no keys: max -inf, sum 0, output 0,
    # so its weight exp(-inf - global_max) is 0. Partition 0 always has keys.
    maxes = tl.load(partial_max_ptr + stat_index, mask=partition_mask, other=float("-inf"))
    sums = tl.load(partial_sum_ptr + stat_index, mask=partition_mask, other=0.0)
    outs = tl.load(
        partial_out_ptr + stat_index[:, None] * HEAD_DIM + dims[None, :],
        mask=partition_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )  # [partition, dim]
    weights = tl.exp(maxes - tl.max(maxes, axis=0))
    result = tl.sum(outs * weights[:, None], axis=0) / tl.sum(sums * weights, axis=0)
    out_ptrs = out_ptr + seq * stride_out_seq + head * stride_out_head + dims * stride_out_dim
    tl.store(out_ptrs, result.to(out_ptr.dtype.element_ty), mask=dim_mask)
