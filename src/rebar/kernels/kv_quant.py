"""The 8-bit KV cache: each head's K or V row stored as llama.cpp's Q8_0 blocks (`-ctk q8_0`).

A row of `head_dim` values is cut into blocks of 32; a block is its scale d = max|x| / 127 as
float16 (2 bytes) followed by the 32 codes round(x / d) as int8, 34 bytes for 32 values (float16
takes 64). A cache holding such rows is a uint8 tensor [num_blocks, block_size, num_kv_heads,
row_bytes(head_dim)]; inside the engine a uint8 KV dtype always means this layout.

The codes are x * (127 / max|x|) rounded half to even, the scale max|x| / 127 then stored as
float16, as llama.cpp's x86 `quantize_row_q8_0` writes its KV cache; the C++ fused decode step
(csrc/decoder.cpp) writes the same bytes, and every attention path reads back code * d.
"""

from __future__ import annotations

import torch

from rebar.errors import InvalidRequestError

NAME = "q8_0"  # the setting's name (`[engine] kv_cache_dtype`), as llama.cpp's -ctk/-ctv call it
STORAGE_DTYPE = torch.uint8
BLOCK = 32
BLOCK_BYTES = 2 + BLOCK


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype == STORAGE_DTYPE


def setting_name(dtype: torch.dtype) -> str:
    """`[engine] kv_cache_dtype`'s name for a cache stored as `dtype`."""
    return NAME if is_quantized(dtype) else str(dtype).removeprefix("torch.")


def row_bytes(head_dim: int) -> int:
    """Bytes of one head's row as Q8_0 blocks; the one check that the row is whole blocks
    (InvalidRequestError naming the setting, before any cache is sized or made)."""
    if head_dim % BLOCK:
        raise InvalidRequestError(
            f"kv_cache_dtype = {NAME!r} needs head_dim a multiple of {BLOCK} (the Q8_0 block); "
            f"this model's is {head_dim}",
            "kv_cache_dtype",
        )
    return head_dim // BLOCK * BLOCK_BYTES


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """The last dimension of a cache of `dtype` holding rows of `head_dim` values."""
    return row_bytes(head_dim) if is_quantized(dtype) else head_dim


def bytes_per_row(head_dim: int, dtype: torch.dtype) -> int:
    return row_bytes(head_dim) if is_quantized(dtype) else head_dim * dtype.itemsize


def quantize(x: torch.Tensor) -> torch.Tensor:
    """x [..., head_dim] (any float dtype) as Q8_0 rows: uint8 [..., row_bytes(head_dim)]."""
    head_dim = x.shape[-1]
    blocks = x.float().reshape(*x.shape[:-1], head_dim // BLOCK, BLOCK)
    amax = blocks.abs().amax(-1, keepdim=True)
    scale = amax / 127
    inverse = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    codes = torch.round(blocks * inverse).to(torch.int8)
    packed = torch.cat([scale.to(torch.float16).view(torch.uint8), codes.view(torch.uint8)], -1)
    return packed.reshape(*x.shape[:-1], row_bytes(head_dim))


def dequantize(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Q8_0 rows uint8 [..., row_bytes] back to values [..., head_dim] in `dtype`."""
    blocks = rows.reshape(*rows.shape[:-1], rows.shape[-1] // BLOCK_BYTES, BLOCK_BYTES)
    scale = blocks[..., :2].contiguous().view(torch.float16).float()
    codes = blocks[..., 2:].contiguous().view(torch.int8).float()
    return (codes * scale).reshape(*rows.shape[:-1], -1).to(dtype)


def to_storage(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x [..., head_dim] as a cache of `dtype` stores it."""
    return quantize(x) if is_quantized(dtype) else x.to(dtype)


def from_storage(stored: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cache contents back as values in `dtype`."""
    return dequantize(stored, dtype) if is_quantized(stored.dtype) else stored.to(dtype)
