"""Put together an engine core's speculator from its settings."""

from __future__ import annotations

import logging

from rebar.engine.engine_config import EngineConfig
from rebar.engine.runner import ModelRunner
from rebar.engine.spec.calibration import measure_step_cost
from rebar.engine.spec.draft_model import DraftModel, DraftModelDrafter
from rebar.engine.spec.ngram import NgramDrafter
from rebar.engine.spec.speculator import Drafter, Speculator
from rebar.kernels.attention import KVCache

logger = logging.getLogger("rebar.engine")


def build_speculator(
    config: EngineConfig,
    runner: ModelRunner,
    num_blocks: int,
    draft: DraftModel | None = None,
) -> Speculator:
    """The speculator for `runner`'s model: n-gram drafts, or `draft`'s, priced by this machine's
    measured steps (the draft model's steps too)."""
    max_rows = min(
        config.max_num_batched_tokens, config.max_num_seqs * (1 + config.max_draft_tokens)
    )
    cost = measure_step_cost(runner, num_blocks, max_rows)
    if draft is None:
        drafter: Drafter = NgramDrafter()
        return Speculator(drafter, cost, config.max_draft_tokens)
    draft_runner = ModelRunner(
        draft.model,
        draft.config,
        draft_kv_cache(draft, runner.kv_cache),
        runner.device,
        fused_decode=config.fused_decode,
    )
    draft_seconds = measure_step_cost(draft_runner, num_blocks, 2)(1)
    logger.info("speculative decoding: drafts from %s", draft.name)
    return Speculator(
        DraftModelDrafter(draft_runner, runner.config.vocab_size),
        cost,
        config.max_draft_tokens,
        seconds_per_draft=draft_seconds,
    )


def draft_kv_cache(draft: DraftModel, kv_cache: KVCache) -> KVCache:
    """The draft model's KV cache: as many blocks as the engine's, of the same size and dtype."""
    return KVCache(
        draft.config.num_layers,
        kv_cache.num_blocks,
        kv_cache.block_size,
        draft.config.num_kv_heads,
        draft.config.head_dim,
        kv_cache.dtype,
        kv_cache.keys[0].device,
    )
