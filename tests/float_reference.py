"""The float reference path of rebar, for tests that compare model math with transformers or
llama.cpp.

By default rebar keeps GGUF weights quantized and stores a float32 model's KV cache in float16 on
the CPU; the reference expands every weight to float32 and keeps K/V in float32, so only float32
round-off separates it from an independent float implementation.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rebar import LLM
from rebar.llm import engine_config


def float_llm(model: str | Path, **engine: Any) -> LLM:
    """`model` loaded as the float32 reference on the CPU; `engine` overrides EngineConfig fields."""
    config = engine_config(**{"kv_cache_dtype": "float32", **engine})
    return LLM(
        model=str(model), dtype="float32", device="cpu", dequantize=True, engine_config=config
    )
