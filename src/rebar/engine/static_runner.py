"""Static batching: prefill every prompt in one step, then decode all of them until each finishes.

This is the plain loop behind `LLM.generate` for a fixed batch of prompts. It shares the model
interface of the serving engine (flattened tokens, paged KV blocks, `AttentionMetadata`) but
allocates each sequence's blocks once up front for its worst case.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from rebar.engine.detokenizer import IncrementalDetokenizer
from rebar.engine.outputs import StepOutput
from rebar.engine.sampler import make_generator, sample
from rebar.engine.sampling_params import SamplingParams
from rebar.kernels.attention import AttentionMetadata, KVCache, pad_block_tables
from rebar.model.config import ModelConfig
from rebar.model.tokenizer import Tokenizer


@dataclass
class _Sequence:
    index: int
    prompt_ids: list[int]
    params: SamplingParams
    max_len: int  # prompt + generated tokens never exceed this
    detokenizer: IncrementalDetokenizer
    generator: torch.Generator | None
    first_block: int = 0
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)


def _blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class StaticBatchRunner:
    def __init__(
        self,
        model: nn.Module,
        config: ModelConfig,
        tokenizer: Tokenizer,
        max_model_len: int,
        dtype: torch.dtype,
        device: torch.device,
        block_size: int = 16,
    ) -> None:
        self.model, self.config, self.tokenizer = model, config, tokenizer
        self.max_model_len, self.dtype, self.device, self.block_size = max_model_len, dtype, device, block_size

    def new_cache(self, num_blocks: int) -> KVCache:
        c = self.config
        return KVCache(c.num_layers, num_blocks, self.block_size, c.num_kv_heads, c.head_dim, self.dtype, self.device)

    @torch.inference_mode()
    def forward(self, cache: KVCache, chunks: Sequence[tuple[list[int], int, int]]) -> torch.Tensor:
        """Run one step. Each chunk is (new token ids, tokens already cached, first block id).

        Returns hidden states [num_tokens, hidden] for every new token, in chunk order.
        """
        ids, positions, slots, tables = [], [], [], []
        query_lens, context_lens = [], []
        for new_ids, num_cached, first_block in chunks:
            start = num_cached
            end = num_cached + len(new_ids)
            ids.extend(new_ids)
            positions.extend(range(start, end))
            slots.extend(first_block * self.block_size + p for p in range(start, end))
            tables.append(list(range(first_block, first_block + _blocks_for(end, self.block_size))))
            query_lens.append(len(new_ids))
            context_lens.append(end)
        meta = AttentionMetadata(
            query_lens=tuple(query_lens),
            context_lens=tuple(context_lens),
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=self.device),
            block_tables=pad_block_tables(tables, self.device),
        )
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        return self.model(input_ids, torch.tensor(positions, dtype=torch.long, device=self.device), meta, cache)

    def run(self, prompts: Sequence[list[int]], params: Sequence[SamplingParams]) -> Iterator[StepOutput]:
        """Generate for every prompt; yields one StepOutput per generated token as it is produced."""
        sequences = [self._new_sequence(i, p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
        next_block = 0
        for seq in sequences:
            seq.first_block = next_block
            next_block += _blocks_for(seq.max_len, self.block_size)
        cache = self.new_cache(next_block)

        active = list(sequences)
        pending = {seq.index: list(seq.prompt_ids) for seq in sequences}
        while active:
            chunks = [(pending[s.index], s.num_tokens - len(pending[s.index]), s.first_block) for s in active]
            hidden = self.forward(cache, chunks)
            last_rows = torch.tensor([len(c[0]) for c in chunks], device=self.device).cumsum(0) - 1
            logits = self.model.compute_logits(hidden[last_rows]).cpu()
            still_active = []
            for row, seq in enumerate(active):
                token = sample(logits[row], seq.params, seq.generator)
                yield self._append(seq, token)
                if seq.finish_reason is None:
                    pending[seq.index] = [token]
                    still_active.append(seq)
            active = still_active

    def _new_sequence(self, index: int, prompt_ids: list[int], params: SamplingParams) -> _Sequence:
        budget = self.max_model_len - len(prompt_ids)
        max_len = self.max_model_len if params.max_tokens is None else len(prompt_ids) + min(params.max_tokens, budget)
        detokenizer = IncrementalDetokenizer(self.tokenizer, params.stop, params.skip_special_tokens)
        return _Sequence(index, list(prompt_ids), params, max_len, detokenizer, make_generator(params))

    def _append(self, seq: _Sequence, token: int) -> StepOutput:
        seq.output_ids.append(token)
        params = seq.params
        if token in self.tokenizer.special.eos_token_ids and not params.ignore_eos:
            seq.finish_reason, seq.stop_reason = "stop", None
        elif token in params.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", token
        delta = "" if seq.finish_reason else seq.detokenizer.add(token)
        if seq.detokenizer.stopped:
            seq.finish_reason, seq.stop_reason = "stop", seq.detokenizer.stop_string
        elif seq.finish_reason is None and seq.num_tokens >= seq.max_len:
            seq.finish_reason = "length"
        if seq.finish_reason is not None:
            delta += seq.detokenizer.finish()
        return StepOutput(seq.index, token, delta, seq.finish_reason, seq.stop_reason)
