"""Engine settings (frozen), defined once here, and the KV-cache sizing that follows from them.

Each field's type, default, bounds and help text are declared on `EngineConfig` (see
rebar.engine.setting); rebar.config derives the `[engine]` settings section from them and the
command line its flags. torch is imported inside the functions that use it so that loading those
definitions (every `rebar` command, `rebar config show`) stays light.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, get_args

from rebar.engine.setting import check_settings, setting, setting_specs

if TYPE_CHECKING:
    import torch

    from rebar.model.config import ModelConfig

logger = logging.getLogger("rebar.engine")

CPU_KV_CACHE_CAP = 2 * 2**30  # bytes; a CPU box shares its memory with everything else

# The one table of floating-point dtype names (each the name of a torch dtype): a model's compute
# dtype (models.dtype) and the KV cache's storage (engine.kv_cache_dtype) are among these.
DtypeName = Literal["float32", "float16", "bfloat16"]
DTYPE_NAMES: tuple[str, ...] = get_args(DtypeName)
KvCacheDtype = Literal["auto", DtypeName]


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype called `name`, one of DTYPE_NAMES."""
    import torch

    assert name in DTYPE_NAMES, name
    dtype: torch.dtype = getattr(torch, name)
    return dtype


@dataclass(frozen=True)
class EngineConfig:
    """How the engine batches and how much memory it gives the KV cache.

    Every value is checked at construction: a bad one raises rebar.errors.ConfigError naming the
    setting (`engine.block_size`) and what it allows. `kv_cache_memory` (bytes) wins when set;
    otherwise `kv_cache_fraction` of the device's available memory, capped at 2 GiB on CPU.
    float16 K/V halve the cache's memory and the bytes each decode step reads from it; attention
    still computes in the model's dtype.
    """

    block_size: int = setting(16, "Tokens per KV-cache block.", ge=1)
    max_num_seqs: int = setting(32, "Most sequences running in one batch.", ge=1)
    max_num_batched_tokens: int = setting(
        2048, "Most tokens (prefill + decode) computed in one engine step.", ge=1
    )
    max_model_len: int | None = setting(
        None, "Longest prompt + completion in tokens; unset: the model's context window.", ge=2
    )
    kv_cache_memory: int | None = setting(
        None, "KV-cache budget in bytes; wins over kv_cache_fraction when set.", gt=0
    )
    kv_cache_fraction: float = setting(
        0.2,
        "Share of available device memory for the KV cache; capped at 2 GiB on CPU.",
        gt=0.0,
        le=1.0,
    )
    enable_prefix_caching: bool = setting(
        True, "Reuse KV blocks of shared prompt prefixes across requests."
    )
    attention_backend: str | None = setting(
        None, 'Attention kernel ("torch" or "batched"); unset: the best one for the device.'
    )
    fused_decode: bool = setting(
        True,
        "Run decode steps of a quantized Llama-family model on the CPU in one fused C++ call "
        "(rebar.model.fused_decode) when it applies; off: the model's own forward, op by op.",
    )
    kv_cache_dtype: KvCacheDtype = setting(
        "auto",
        "How K/V are stored: auto (float16 for a float32 model on the CPU, as llama.cpp's "
        "default; else the model's dtype) or a dtype; float16 holds twice the tokens.",
    )

    def __post_init__(self) -> None:
        check_settings(self, "engine")

    def kv_dtype(self, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
        """The KV cache's storage dtype for a model running in `model_dtype` on `device`."""
        import torch

        if self.kv_cache_dtype != "auto":
            return torch_dtype(self.kv_cache_dtype)
        return (
            torch.float16 if device.type == "cpu" and model_dtype == torch.float32 else model_dtype
        )


ENGINE_SETTINGS = setting_specs(EngineConfig, "engine")


def kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * dtype.itemsize


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
    engine: EngineConfig, model: ModelConfig, dtype: torch.dtype, device: torch.device
) -> int:
    """Blocks that fit the memory budget; at least enough for one full-length sequence."""
    budget = kv_cache_budget(engine, device)
    bytes_per_block = kv_bytes_per_token(model, dtype) * engine.block_size
    return budget // bytes_per_block
