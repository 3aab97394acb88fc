"""The `[engine]` section: how the engine batches, sizes its KV cache and which kernels it runs.

These fields are the one definition of the engine's settings (type, default, bounds, help); the
engine itself receives their values as a plain `rebar.engine.engine_config.EngineConfig`, built by
whoever starts it from `engine_fields()`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from rebar.config.base import Section, Unsettable
from rebar.dtypes import DtypeName

KvCacheDtype = Literal["auto", DtypeName, "q8_0"]
# Settings of the process that runs an engine, not of the engine itself.
PROCESS_FIELDS = frozenset({"num_threads", "separate_process"})


class EngineSettings(Section):
    """The `[engine]` section. Every field but `num_threads` and `separate_process` reaches the
    engine (`engine_fields()`)."""

    block_size: int = Field(16, ge=1, description="Tokens per KV-cache block.")
    max_num_seqs: int = Field(32, ge=1, description="Most sequences running in one batch.")
    max_num_batched_tokens: int = Field(
        2048, ge=1, description="Most tokens (prefill + decode) computed in one engine step."
    )
    max_prefill_tokens_while_decoding: int = Field(
        64,
        ge=1,
        description="Most prompt tokens computed in a step while requests are decoding, no fewer "
        "of them than requests with a prompt to prefill, so a long prompt delays the others' next "
        "tokens by a short step at a time (a burst of more prompts prefills at full speed).",
    )
    prefill_beside_decode: bool = Field(
        True,
        description="On the CPU, a prompt longer than max_prefill_tokens_while_decoding that "
        "arrives while requests decode prefills on a thread of its own beside their steps, in "
        "chunks of up to max_num_batched_tokens, sharing the cores with them instead of adding its "
        "chunks to their steps (docs/benchmarks.md); off: in the steps, capped per step.",
    )
    prefill_beside_threads: Annotated[Annotated[int, Field(ge=1)] | None, Unsettable] = Field(
        None,
        description="Threads a prompt chunk computes on beside the steps, which run on the rest "
        "of the engine's threads meanwhile; unset: half of them (at least one); as many as the "
        "engine's or more: both use every thread and the operating system interleaves them.",
    )
    max_model_len: Annotated[Annotated[int, Field(ge=2)] | None, Unsettable] = Field(
        None,
        description="Longest prompt + completion in tokens; unset: the model's context window.",
    )
    kv_cache_memory: Annotated[Annotated[int, Field(gt=0)] | None, Unsettable] = Field(
        None, description="KV-cache budget in bytes; wins over kv_cache_fraction when set."
    )
    kv_cache_fraction: float = Field(
        0.2,
        gt=0.0,
        le=1.0,
        description="Share of available device memory for the KV cache; capped at 2 GiB on CPU.",
    )
    enable_prefix_caching: bool = Field(
        True, description="Reuse KV blocks of shared prompt prefixes across requests."
    )
    # The names are the kernel registry's (rebar.kernels.backends); it refuses unknown ones.
    attention_backend: Annotated[str | None, Unsettable] = Field(
        None,
        description='Attention kernel ("torch", "batched" or "triton"); unset: the best one for '
        "the device.",
    )
    fused_decode: bool = Field(
        True,
        description="Run decode steps of a quantized Llama-family model on the CPU in one fused "
        "C++ call (rebar.model.fused_decode) when it applies; off: the model's own forward, op by "
        "op.",
    )
    kv_cache_dtype: KvCacheDtype = Field(
        "auto",
        description="How K/V are stored: auto (float16 for a float32 model on the CPU, as "
        "llama.cpp's default; else the model's dtype), a dtype, or q8_0 (8-bit blocks of 32 with "
        "a float16 scale, llama.cpp's -ctk/-ctv q8_0; head_dim a multiple of 32); float16 holds "
        "twice the tokens of float32, q8_0 1.9 times float16's (docs/kernels.md).",
    )
    # On: `rebar bench spec` measured no workload more than 3% slower with it (docs/speculative.md).
    speculative: bool = Field(
        True,
        description="Speculative decoding: draft tokens (from n-grams of the prompt and output, or "
        "from draft_model) and check them all in one pass of the model; the output is unchanged, "
        "and it comes faster where drafts hold (docs/speculative.md).",
    )
    draft_model: Annotated[str | None, Unsettable] = Field(
        None,
        description="A model with the same vocabulary that drafts tokens for speculative decoding "
        "(a path or a bundled name, loaded like the model; needs speculative = true); unset: "
        "drafts come from n-gram lookup.",
    )
    max_draft_tokens: int = Field(
        16,
        ge=1,
        le=64,
        description="Most draft tokens one sequence checks in a step; each step picks fewer, or "
        "none, where more would not pay.",
    )
    num_threads: Annotated[Annotated[int, Field(ge=1)] | None, Unsettable] = Field(
        None, description="torch threads for the model's math; unset: torch's default."
    )
    # On 2 cores it measured no faster than the default thread (docs/benchmarks.md) and costs a
    # second interpreter with torch (~160 MiB private memory).
    separate_process: bool = Field(
        False,
        description="Run each chat engine in a process of its own (rebar.engine.engine_process), "
        "so the HTTP side's Python work never waits for the engine's GIL and a crash in a kernel "
        "leaves a server that reports it.",
    )

    def engine_fields(self) -> dict[str, Any]:
        """The values `EngineConfig` takes (every field but the process's own)."""
        return self.model_dump(exclude=set(PROCESS_FIELDS))
