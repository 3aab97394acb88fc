"""Registry of attention backends: a name -> a lazily imported paged-attention callable.

Every backend has the signature of the reference `rebar.kernels.attention.paged_attention`:
`(q, k, v, key_cache, value_cache, meta, scale, sliding_window) -> out`, writes this step's K/V
into the cache, and agrees with the reference to floating-point round-off. A backend's module
is imported only when that backend is asked for, so optional fast kernels cost nothing unless used.
"""

from __future__ import annotations

import importlib
from typing import Protocol

import torch

from rebar.errors import InvalidRequestError
from rebar.kernels.attention import AttentionMetadata


class AttentionBackend(Protocol):
    def __call__(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor: ...  # [num_tokens, num_heads, head_dim]


# name -> "module:function", imported on first use.
ATTENTION_BACKENDS: dict[str, str] = {
    "torch": "rebar.kernels.attention:paged_attention",
    "batched": "rebar.kernels.attention_batched:batched_paged_attention",
}


def get_attention_backend(name: str) -> AttentionBackend:
    """The attention callable registered as `name`.

    Raises InvalidRequestError (param "attention_backend") naming the known backends when
    `name` is not one of them.
    """
    target = ATTENTION_BACKENDS.get(name) if isinstance(name, str) else None
    if target is None:
        known = ", ".join(sorted(ATTENTION_BACKENDS))
        raise InvalidRequestError(f"unknown attention backend {name!r}; known: {known}", "attention_backend")
    module_name, function_name = target.split(":")
    return getattr(importlib.import_module(module_name), function_name)


def default_attention_backend(device: torch.device) -> str:
    """The backend used when none is named: "batched" on every device (it needs no CUDA)."""
    del device  # every registered backend runs everywhere; kept so a device-specific kernel can slot in
    return "batched"
