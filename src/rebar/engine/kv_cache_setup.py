"""The engine's KV cache tensors, sized from its settings and the model."""

from __future__ import annotations

import logging

import torch

from rebar.engine.engine_config import EngineConfig, kv_bytes_per_token, num_kv_blocks
from rebar.engine.spec.draft_model import DraftModel
from rebar.errors import InvalidRequestError
from rebar.kernels import kv_quant
from rebar.kernels.attention import KVCache
from rebar.model.config import ModelConfig

logger = logging.getLogger("rebar.engine")


def build_kv_cache(
    config: EngineConfig,
    model_config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    max_model_len: int,
    draft: DraftModel | None,
) -> KVCache:
    """The engine's KV cache, sized by `config` (a draft model's own cache shares the budget);
    raises InvalidRequestError when it cannot hold one sequence of `max_model_len` tokens."""
    kv_dtype = config.kv_dtype(dtype, device)
    num_blocks = num_kv_blocks(
        config, model_config, kv_dtype, device, None if draft is None else draft.config
    )
    if num_blocks * config.block_size < max_model_len:
        raise InvalidRequestError(
            f"the KV cache holds {num_blocks * config.block_size} tokens, fewer than "
            f"max_model_len={max_model_len}; raise kv_cache_memory or lower max_model_len",
            "kv_cache_memory",
        )
    kv_cache = KVCache(
        model_config.num_layers,
        num_blocks,
        config.block_size,
        model_config.num_kv_heads,
        model_config.head_dim,
        kv_dtype,
        device,
    )
    logger.info(
        "KV cache: %d blocks x %d tokens = %d tokens, %.1f MiB (%s, %d bytes/token)",
        num_blocks,
        config.block_size,
        num_blocks * config.block_size,
        kv_cache.num_bytes / 2**20,
        kv_quant.setting_name(kv_dtype),
        kv_bytes_per_token(model_config, kv_dtype),
    )
    return kv_cache
