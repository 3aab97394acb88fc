"""Turn a scheduler's plain-data plan into tensors, run the model once, return logits to sample
from."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from rebar.engine.scheduler import ScheduledRequest
from rebar.kernels.attention import AttentionMetadata, KVCache, pad_block_tables
from rebar.model.config import ModelConfig

if TYPE_CHECKING:
    from rebar.model.fused_decode import FusedDecoder

logger = logging.getLogger("rebar.engine")


class ModelRunner:
    """Owns the model and its KV cache tensors; knows nothing about requests beyond a step's
    plan."""

    def __init__(
        self,
        model: nn.Module,
        config: ModelConfig,
        kv_cache: KVCache,
        device: torch.device,
        fused_decode: bool = True,
    ) -> None:
        self.model = model
        self.config = config
        self.kv_cache = kv_cache
        self.device = device
        self.block_size = kv_cache.block_size
        self.fused_decoder: FusedDecoder | None = (
            self._build_fused_decoder() if fused_decode and device.type == "cpu" else None
        )

    def _build_fused_decoder(self) -> FusedDecoder | None:
        from rebar.model.fused_decode import FusedDecoder

        outcome = FusedDecoder.build(self.model, self.kv_cache)
        if outcome.decoder is None:
            logger.info("fused CPU decode step off: %s", outcome.reason)
        else:
            limit = outcome.decoder.max_rows
            logger.info(
                "fused CPU decode step on: decode steps of %s run in one C++ call",
                "any size" if limit == math.inf else f"up to {limit} sequences",
            )
        return outcome.decoder

    def _metadata(
        self, items: Sequence[ScheduledRequest]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        for item in items:
            ids.extend(item.token_ids)
            end = item.start_position + len(item.token_ids)
            for position in range(item.start_position, end):
                positions.append(position)
                slots.append(
                    item.block_ids[position // self.block_size] * self.block_size
                    + position % self.block_size
                )
        meta = AttentionMetadata(
            query_lens=tuple(len(item.token_ids) for item in items),
            context_lens=tuple(item.start_position + len(item.token_ids) for item in items),
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=self.device),
            block_tables=pad_block_tables([list(item.block_ids) for item in items], self.device),
        )
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        return input_ids, torch.tensor(positions, dtype=torch.long, device=self.device), meta

    @torch.inference_mode()
    def execute(self, items: Sequence[ScheduledRequest]) -> torch.Tensor:
        """Run one step; returns float32 logits [number of items with `sample`, vocab] on the CPU,
        in order.

        With the fused decoder, a step's decode rows (one new token each; at most `max_rows` of
        them, else everything takes the model) go through it, and the prompt chunks beside them
        through the model: sequences are independent, so the two passes compute what one would, and
        a decode row's numbers do not depend on whether a prefill shares its step.
        """
        decode = [i for i, item in enumerate(items) if len(item.token_ids) == 1]
        if self.fused_decoder is None or not 0 < len(decode) <= self.fused_decoder.max_rows:
            decode = []
        fused_rows = set(decode)
        others = [i for i in range(len(items)) if i not in fused_rows]
        sampled: dict[int, torch.Tensor] = {}  # item index -> its last token's hidden state
        for group, fused in ((decode, True), (others, False)):
            if not group:
                continue
            chosen = [items[i] for i in group]
            input_ids, positions, meta = self._metadata(chosen)
            if fused:
                assert self.fused_decoder is not None  # only then is `decode` non-empty
                hidden = self.fused_decoder(input_ids, positions, meta)
            else:
                hidden = self.model(
                    input_ids, positions, meta, self.kv_cache
                )  # [num_tokens, hidden]
            ends = torch.tensor(meta.query_lens, device=self.device).cumsum(0) - 1
            for index, item, end in zip(group, chosen, ends.tolist()):
                if item.sample:
                    sampled[index] = hidden[end]
        if not sampled:
            return torch.empty(0, self.config.vocab_size)
        rows = torch.stack([sampled[i] for i in sorted(sampled)])
        return self._logits(rows)

    @torch.inference_mode()
    def teacher_forced_logits(self, token_ids: list[int]) -> torch.Tensor:
        """Logits at every position of one sequence, using a private cache (the shared pool is
        untouched)."""
        c = self.config
        num_blocks = -(-len(token_ids) // self.block_size)
        cache = KVCache(
            c.num_layers,
            num_blocks,
            self.block_size,
            c.num_kv_heads,
            c.head_dim,
            self.kv_cache.keys[0].dtype,
            self.device,
        )
        item = ScheduledRequest(
            "logits", tuple(token_ids), 0, tuple(range(num_blocks)), sample=True
        )
        input_ids, positions, meta = self._metadata([item])
        hidden = self.model(input_ids, positions, meta, cache)
        return self._logits(hidden)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, vocab] float32 on the CPU
        compute_logits = self.model.compute_logits
        assert callable(compute_logits)  # the decoder's head (nn.Module types attributes loosely)
        return compute_logits(hidden).cpu()
