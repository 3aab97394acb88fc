"""Registry of attention backends: a name -> a lazily imported paged-attention callable.

Every backend has the signature of the reference `rebar.kernels.attention.paged_attention`:
`(q, k, v, key_cache, value_cache, meta, scale, sliding_window) -> out`, writes this step's K/V
into the cache, and agrees with the reference to floating-point round-off. A backend's module
is imported only when that backend is asked for, so optional fast kernels cost nothing unless used.
"""

from __future__ import annotations

import functools
import importlib
import logging
from typing import Protocol

import torch

from rebar.errors import InvalidRequestError
from rebar.kernels.attention import AttentionMetadata

logger = logging.getLogger("rebar.kernels")


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
    "triton": "rebar.kernels.triton_attention:triton_paged_attention",
}


def get_attention_backend(name: str) -> AttentionBackend:
    """The attention callable registered as `name`.

    Raises InvalidRequestError (param "attention_backend") naming the known backends when
    `name` is not one of them.
    """
    target = ATTENTION_BACKENDS.get(name) if isinstance(name, str) else None
    if target is None:
        known = ", ".join(sorted(ATTENTION_BACKENDS))
        raise InvalidRequestError(
            f"unknown attention backend {name!r}; known: {known}", "attention_backend"
        )
    module_name, function_name = target.split(":")
    return getattr(importlib.import_module(module_name), function_name)


def default_attention_backend(device: torch.device) -> str:
    """The backend used when none is named.

    "batched" on CPU. On a CUDA device "triton" when CUDA is usable and Triton imports; otherwise
    "batched", with the reason logged once per process.
    """
    if device.type == "cpu":
        return "batched"
    reason = _triton_unavailable_reason(device.type)
    return "batched" if reason else "triton"


@functools.cache  # so the fallback warning is logged once, not once per model built
def _triton_unavailable_reason(device_type: str) -> str | None:
    reason = None
    if device_type != "cuda" or not torch.cuda.is_available():
        reason = f"no CUDA (device {device_type!r})"
    else:
        try:
            import triton  # noqa: F401
        except ImportError as error:
            reason = f"Triton is not installed ({error}); pip install triton"
    if reason:
        logger.warning("attention backend: using 'batched' instead of 'triton': %s", reason)
    return reason
