"""Engine settings (frozen) and the KV-cache sizing that follows from them."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from rebar.errors import InvalidRequestError
from rebar.model.config import ModelConfig

logger = logging.getLogger("rebar.engine")

CPU_KV_CACHE_CAP = 2 * 2**30  # bytes; a CPU box shares its memory with everything else
KV_CACHE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class EngineConfig:
    """How the engine batches and how much memory it gives the KV cache.

    `kv_cache_memory` (bytes) wins when set; otherwise `kv_cache_fraction` of the device's available
    memory, capped at 2 GiB on CPU. `max_model_len` defaults to the model's context window.
    `kv_cache_dtype` is how keys and values are stored: "auto" (float16 for a float32 model on the
    CPU, as llama.cpp's default f16 cache; else the model's dtype) or one of KV_CACHE_DTYPES.
    float16 halves the cache's memory and the bytes each decode step reads from it; attention still
    computes in the model's dtype.
    """

    block_size: int = 16
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    kv_cache_memory: int | None = None
    kv_cache_fraction: float = 0.2
    enable_prefix_caching: bool = True
    attention_backend: str | None = None  # None: the best one for the device
    # Run pure-decode steps of a quantized Llama-family model on the CPU through rebar's fused C++
    # decode step (rebar.model.fused_decode) when it applies; off: always the model's own forward.
    fused_decode: bool = True
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        checks = {
            "block_size": self.block_size >= 1,
            "max_num_seqs": self.max_num_seqs >= 1,
            "max_num_batched_tokens": self.max_num_batched_tokens >= 1,
            "max_model_len": self.max_model_len is None or self.max_model_len >= 2,
            "kv_cache_memory": self.kv_cache_memory is None or self.kv_cache_memory > 0,
            "kv_cache_fraction": 0.0 < self.kv_cache_fraction <= 1.0,
            "kv_cache_dtype": self.kv_cache_dtype == "auto"
            or self.kv_cache_dtype in KV_CACHE_DTYPES,
        }
        for name, ok in checks.items():
            if not ok:
                raise InvalidRequestError(
                    f"invalid engine setting {name}={getattr(self, name)!r}", name
                )

    def kv_dtype(self, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
        """The KV cache's storage dtype for a model running in `model_dtype` on `device`."""
        if self.kv_cache_dtype != "auto":
            return KV_CACHE_DTYPES[self.kv_cache_dtype]
        return (
            torch.float16 if device.type == "cpu" and model_dtype == torch.float32 else model_dtype
        )


def kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
    return (
        2
        * config.num_layers
        * config.num_kv_heads
        * config.head_dim
        * torch.empty(0, dtype=dtype).element_size()
    )


def available_memory(device: torch.device) -> int:
    if device.type == "cuda":
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


def num_kv_blocks(
    engine: EngineConfig, model: ModelConfig, dtype: torch.dtype, device: torch.device
) -> int:
    """Blocks that fit the memory budget; at least enough for one full-length sequence."""
    budget = engine.kv_cache_memory
    if budget is None:
        budget = int(engine.kv_cache_fraction * available_memory(device))
        if device.type == "cpu":
            budget = min(budget, CPU_KV_CACHE_CAP)
    bytes_per_block = kv_bytes_per_token(model, dtype) * engine.block_size
    return budget // bytes_per_block
