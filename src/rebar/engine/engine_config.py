"""The engine's configuration as plain frozen values, and the KV-cache sizing that follows from
them.

The settings themselves (defaults, bounds, help) are defined once, in `rebar.config`
(`EngineSettings`); whoever starts an engine builds an `EngineConfig` from them
(`EngineConfig(**settings.engine.engine_fields())`) and the engine takes the values as they are.
torch is imported inside the functions that use it so that this module stays light.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rebar.dtypes import DTYPE_NAMES

if TYPE_CHECKING:
    import torch

    from rebar.model.config import ModelConfig

logger = logging.getLogger("rebar.engine")

CPU_KV_CACHE_CAP = 2 * 2**30  # bytes; a CPU box shares its memory with everything else


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype called `name`, one of DTYPE_NAMES."""
    import torch

    assert name in DTYPE_NAMES, name
    dtype: torch.dtype = getattr(torch, name)
    return dtype


@dataclass(frozen=True)
class EngineConfig:
    """How the engine batches and how much memory it gives the KV cache (checked values: see
    `rebar.config.EngineSettings` for what each means and allows).

    `kv_cache_memory` (bytes) wins when set; otherwise `kv_cache_fraction` of the device's available
    memory, capped at 2 GiB on CPU. float16 K/V halve the cache's memory and the bytes each decode
    step reads from it; attention still computes in the model's dtype.
    """

    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_prefill_tokens_while_decoding: int
    prefill_beside_decode: bool  # long prompts prefill on a thread beside decode steps (CPU)
    prefill_beside_threads: int | None  # the chunk's share of the threads; None: half
    max_model_len: int | None  # None: the model's context window
    kv_cache_memory: int | None
    kv_cache_fraction: float
    enable_prefix_caching: bool
    attention_backend: str | None  # None: the best one for the device
    fused_decode: bool
    kv_cache_dtype: str  # "auto", one of DTYPE_NAMES, or "q8_0" (rebar.kernels.kv_quant)
    speculative: bool  # draft tokens and check them in one pass (docs/speculative.md)
    draft_model: str | None  # None: drafts come from n-gram lookup
    max_draft_tokens: int

    def kv_dtype(self, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
        """The KV cache's storage dtype for a model running in `model_dtype` on `device` (uint8:
        Q8_0 rows, `rebar.kernels.kv_quant`)."""
        import torch

        from rebar.kernels import kv_quant

        if self.kv_cache_dtype == kv_quant.NAME:
            return kv_quant.STORAGE_DTYPE
        if self.kv_cache_dtype != "auto":
            return torch_dtype(self.kv_cache_dtype)
        return (
            torch.float16 if device.type == "cpu" and model_dtype == torch.float32 else model_dtype
        )


def kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
    from rebar.kernels import kv_quant

    return (
        2 * config.num_layers * config.num_kv_heads * kv_quant.bytes_per_row(config.head_dim, dtype)
    )


def available_memory(device: torch.device) -> int:
    if device.type == "cuda":
        import torch

        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def kv_cache_budget(engine: EngineConfig, device: torch.device) -> int:
    """Bytes for the KV cache: `kv_cache_memory`, else `kv_cache_fraction` of the available memory
    (capped on CPU)."""
    if engine.kv_cache_memory is not None:
        return engine.kv_cache_memory
    budget = int(engine.kv_cache_fraction * available_memory(device))
    return min(budget, CPU_KV_CACHE_CAP) if device.type == "cpu" else budget


def num_kv_blocks(
    engine: EngineConfig,
    model: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    draft: ModelConfig | None = None,
) -> int:
    """Blocks that fit the memory budget (a draft model's KV cache, block for block beside the
    model's, shares it)."""
    budget = kv_cache_budget(engine, device)
    per_token = kv_bytes_per_token(model, dtype)
    if draft is not None:
        per_token += kv_bytes_per_token(draft, dtype)
    bytes_per_block = per_token * engine.block_size
    return budget // bytes_per_block
