"""Turn a scheduler's plain-data plan into tensors, run the model once, return logits to sample
from (or, for a step that samples greedily alone, each row's best token)."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from rebar.engine.scheduler import ScheduledRequest
from rebar.kernels.attention import AttentionMetadata, KVCache, pad_block_tables
from rebar.kernels.best_logits import BestTokens, best_logits
from rebar.model.config import ModelConfig
from rebar.openmp_env import spin_left_at_default

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
            if spin_left_at_default():
                logger.warning(
                    "GOMP_SPINCOUNT and OMP_WAIT_POLICY are unset: torch's OpenMP threads "
                    "busy-wait for milliseconds after each operator, on the cores the fused "
                    "decode step uses, and decoding can run ~30% slower. Call "
                    "rebar.shorten_openmp_spin() before importing torch (as the rebar command "
                    "does) or set GOMP_SPINCOUNT (docs/kernels.md)."
                )
        return outcome.decoder

    def _metadata(
        self, items: Sequence[ScheduledRequest], as_rows: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Input ids, positions and attention metadata for `items`, each a sequence of its new
        tokens; with `as_rows`, and always for an item with drafts, every token is a one-token row
        of its own, seeing its sequence's keys up to itself.

        Rows of one sequence share its block table: the step writes every row's K/V before any row
        attends, so a row reads the tokens before it from the cache exactly as a later decode step
        would, and computes what that step would have (the same numbers on the fused path).
        """
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        context_lens: list[int] = []
        tables: list[list[int]] = []
        prompt_rows: set[int] = set()
        for item in items:
            tokens = item.token_ids + item.draft_token_ids
            ids.extend(tokens)
            end = item.start_position + len(tokens)
            for position in range(item.start_position, end):
                positions.append(position)
                slots.append(
                    item.block_ids[position // self.block_size] * self.block_size
                    + position % self.block_size
                )
            if as_rows or item.draft_token_ids:
                query_lens.extend([1] * len(tokens))
                context_lens.extend(range(item.start_position + 1, end + 1))
                tables.extend([list(item.block_ids)] * len(tokens))
            else:
                if item.prompt and len(tokens) == 1:
                    prompt_rows.add(len(query_lens))
                query_lens.append(len(tokens))
                context_lens.append(end)
                tables.append(list(item.block_ids))
        meta = AttentionMetadata(
            query_lens=tuple(query_lens),
            context_lens=tuple(context_lens),
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=self.device),
            block_tables=pad_block_tables(tables, self.device),
            prompt_rows=frozenset(prompt_rows),
        )
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        return input_ids, torch.tensor(positions, dtype=torch.long, device=self.device), meta

    @torch.inference_mode()
    def execute(self, items: Sequence[ScheduledRequest]) -> torch.Tensor:
        """Run one step; returns float32 logits on the CPU, in item order: for each item with
        `sample`, one row after its last token, preceded by one after each of its tokens before
        its drafts' end when it has drafts (1 + number of drafts rows: what each position samples).
        """
        hidden = self._sampled_hidden(items)
        if hidden is None:
            return torch.empty(0, self.config.vocab_size)
        return self._logits(hidden)

    @torch.inference_mode()
    def execute_greedy(self, items: Sequence[ScheduledRequest]) -> BestTokens:
        """Run one step; returns the greedy token of each row `execute` would return logits for
        (`best_logits` of them), without those logits where the model's head can skip them."""
        hidden = self._sampled_hidden(items)
        if hidden is None:
            return BestTokens.cat([])
        best_tokens = getattr(self.model, "best_tokens", None)  # a model without: from its logits
        if best_tokens is None:
            return best_logits(self._logits(hidden))
        token_ids, valid = best_tokens(hidden)
        return BestTokens(token_ids.cpu(), valid.cpu())

    def _sampled_hidden(self, items: Sequence[ScheduledRequest]) -> torch.Tensor | None:
        """The final hidden states of the rows a step samples (see `execute`), None when none.

        Items adding one token (decode, and verification of drafts, whose tokens all become
        one-token rows) go through the fused decoder when there is one and it takes that many rows;
        prompt chunks (a prompt's lone last token too) go through the model beside them. Sequences
        are independent, so the two passes compute what one would, and a decode row's numbers do
        not depend on whether a prefill shares its step.
        """
        rows = [i for i, item in enumerate(items) if len(item.token_ids) == 1 and not item.prompt]
        num_rows = sum(items[i].num_rows for i in rows)
        if self.fused_decoder is None or not 0 < num_rows <= self.fused_decoder.max_rows:
            rows = []
        fused_rows = set(rows)
        chunks = [i for i in range(len(items)) if i not in fused_rows]
        sampled: dict[int, torch.Tensor] = {}  # item index -> hidden states of its sampled rows
        for group, fused in ((rows, True), (chunks, False)):
            if not group:
                continue
            chosen = [items[i] for i in group]
            input_ids, positions, meta = self._metadata(chosen, as_rows=fused)
            if fused:
                assert self.fused_decoder is not None  # only then is `rows` non-empty
                hidden = self.fused_decoder(input_ids, positions, meta)
            else:
                hidden = self.model(
                    input_ids, positions, meta, self.kv_cache
                )  # [num_tokens, hidden]
            end = 0
            for index, item in zip(group, chosen):
                end += item.num_rows
                if item.sample:
                    sampled[index] = hidden[end - 1 - len(item.draft_token_ids) : end]
        if not sampled:
            return None
        return torch.cat([sampled[i] for i in sorted(sampled)])

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
            self.kv_cache.dtype,
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
