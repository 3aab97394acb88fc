"""Drafts from a second, smaller model with the same vocabulary (`[engine] draft_model`).

The draft model keeps its own KV cache laid out block for block like the engine's: a sequence's
draft K/V sit in the same block ids as its K/V, so the draft needs no allocator of its own, and a
block the engine gives back (after a preemption, or after rejected drafts) takes the draft's K/V
with it. Each sequence remembers how many of its tokens the draft model has computed; before
drafting it catches up over the tokens it has not seen (the prompt, the token sampled last, drafts
that were not kept), then proposes one token at a time.

For a greedy request, or one whose output follows a grammar, a draft is the draft model's argmax
(a guess made with certainty, checked like the n-gram drafter's). For a sampled request without a
grammar it is drawn from the draft model's own distribution under the request's temperature and
filters, and that distribution goes with it, for rejection sampling (`step_sampling`): more of
such drafts hold than argmax guesses would.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from rebar.engine.runner import ModelRunner
from rebar.engine.sampler import SampleRequest, distributions
from rebar.engine.scheduler import ScheduledRequest
from rebar.engine.spec.speculator import Drafting
from rebar.errors import ConfigError
from rebar.model.config import ModelConfig
from rebar.model.tokenizer import Tokenizer


@dataclass(frozen=True)
class DraftModel:
    """A loaded draft model (its vocabulary checked: `check_same_vocabulary`): its name as
    configured, module and config."""

    name: str
    model: nn.Module
    config: ModelConfig


def check_same_vocabulary(
    model_name: str,
    tokenizer: Tokenizer,
    config: ModelConfig,
    draft_name: str,
    draft_tokenizer: Tokenizer,
    draft_config: ModelConfig,
) -> None:
    """Raise ConfigError naming the first difference between the two models' vocabularies: their
    sizes, the width of their logits, or a token id that spells a different token."""
    prefix = f"draft_model {draft_name} cannot draft for {model_name}"
    if draft_tokenizer.vocab_size != tokenizer.vocab_size:
        raise ConfigError(
            f"{prefix}: its vocabulary has {draft_tokenizer.vocab_size} tokens, "
            f"the model's {tokenizer.vocab_size}"
        )
    if draft_config.vocab_size != config.vocab_size:
        raise ConfigError(
            f"{prefix}: it scores {draft_config.vocab_size} token ids, "
            f"the model {config.vocab_size}"
        )
    for token_id in range(tokenizer.vocab_size):
        ours, theirs = tokenizer.id_to_token(token_id), draft_tokenizer.id_to_token(token_id)
        if ours != theirs:
            raise ConfigError(
                f"{prefix}: token {token_id} is {theirs!r} in the draft model's vocabulary "
                f"and {ours!r} in the model's"
            )


# A sampled request's drafts draw from a generator of their own, seeded from the request's seed
# (its own generator serves the verdicts): a seeded request stays reproducible.
DRAFT_SEED_OFFSET = 0x5EED


@dataclass
class DraftProgress:
    """How far the draft model has computed one sequence: its first `num_computed` tokens, then
    `written`, drafts whose K/V it wrote last time (still valid where the sequence kept them);
    `generator` draws a sampled request's drafts (None: the global one)."""

    num_computed: int = 0
    written: tuple[int, ...] = ()
    num_preemptions: int = 0
    generator: torch.Generator | None = None


class DraftModelDrafter:
    """Drafts with a draft model's runner over its own block-mirrored KV cache."""

    name = "draft_model"

    def __init__(self, runner: ModelRunner, vocab_size: int) -> None:
        self.runner = runner
        self.vocab_size = vocab_size  # draft logits past the engine's vocabulary are never taken

    def outlook(self, sequence: Drafting, max_tokens: int) -> int:
        return max_tokens  # whatever is asked, computed once the step's blocks are known

    @torch.inference_mode()
    def draft(self, batch: Sequence[tuple[Drafting, ScheduledRequest]]) -> list[tuple[int, ...]]:
        drafts: list[list[int]] = [[] for _ in batch]
        chances: list[list[torch.Tensor]] = [[] for _ in batch]  # the distributions drawn from
        # Catch up over each sequence's unseen tokens; the last one's logits give the first draft.
        items = [self._catch_up(sequence, item) for sequence, item in batch]
        active = list(range(len(batch)))
        depth = 0
        while active:
            logits = self.runner.execute(items)[:, : self.vocab_size]
            for row, index in enumerate(active):
                token, chance = self._pick(batch[index][0], logits[row])
                drafts[index].append(token)
                if chance is not None:
                    chances[index].append(chance)
            depth += 1
            active = [i for i in active if depth < batch[i][1].num_lookahead]
            items = [self._one_more(batch[i][1], drafts[i], depth) for i in active]
        for (sequence, _), tokens, drawn in zip(batch, drafts, chances):
            progress = _progress(sequence)
            progress.num_computed = sequence.request.num_tokens
            progress.written = tuple(tokens[:-1])  # the last draft's K/V were never computed
            sequence.speculation.draft_probabilities = torch.stack(drawn) if drawn else None
        return [tuple(tokens) for tokens in drafts]

    @staticmethod
    def _pick(sequence: Drafting, logits: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        """The draft token after `logits` ([vocab]): the argmax, or for a sampled request without
        a grammar a draw from the draft model's distribution, returned with it."""
        params = sequence.request.params
        if params.greedy or sequence.matcher is not None:
            return int(logits.argmax()), None
        chance = distributions(logits.unsqueeze(0), [SampleRequest(params, None, (), ())])[0]
        if not chance.sum() > 0:  # the draft model's logits hold NaN: guess anything
            return int(logits.argmax()), None
        generator = _progress(sequence).generator
        if generator is None and params.seed is not None:
            generator = torch.Generator().manual_seed(params.seed ^ DRAFT_SEED_OFFSET)
            _progress(sequence).generator = generator
        return int(torch.multinomial(chance, 1, generator=generator)), chance

    def _catch_up(self, sequence: Drafting, item: ScheduledRequest) -> ScheduledRequest:
        request, progress = sequence.request, _progress(sequence)
        if progress.num_preemptions != request.num_preemptions:  # its blocks were freed
            progress.num_computed, progress.written = 0, ()
            progress.num_preemptions = request.num_preemptions
        tokens = request.token_ids
        valid = progress.num_computed
        for token in progress.written:
            if valid >= len(tokens) - 1 or tokens[valid] != token:
                break
            valid += 1
        return ScheduledRequest(
            request.request_id, tuple(tokens[valid:]), valid, item.block_ids, sample=True
        )

    @staticmethod
    def _one_more(item: ScheduledRequest, drafts: list[int], depth: int) -> ScheduledRequest:
        """The draft model's step over its own last draft, at the position after the one before."""
        position = item.start_position + len(item.token_ids) + depth - 1
        return ScheduledRequest(item.request_id, (drafts[-1],), position, item.block_ids, True)


def _progress(sequence: Drafting) -> DraftProgress:
    speculation = sequence.speculation
    if not isinstance(speculation.drafter_state, DraftProgress):
        speculation.drafter_state = DraftProgress()
    return speculation.drafter_state
