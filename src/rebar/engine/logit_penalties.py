"""logit_bias and the repetition, presence and frequency penalties, applied in place to a batch of
logits (stage 1 of `rebar.engine.sampler`, before the grammar mask).

Each touches only the logits it changes: the bias the tokens it names, the penalties the tokens
in a row's history, so the cost follows the history's length, not the vocabulary's.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Protocol

import torch

from rebar.engine.sampling_params import SamplingParams


class PenalisedRow(Protocol):
    """What the penalties read of a row (the sampler's SampleRequest is one)."""

    @property
    def params(self) -> SamplingParams: ...

    @property
    def prompt_token_ids(self) -> Sequence[int]: ...

    @property
    def output_token_ids(self) -> Sequence[int]: ...


def add_logit_bias(logits: torch.Tensor, params: Sequence[SamplingParams]) -> None:
    """Add every row's logit_bias in place, in one indexed add over the batch."""
    rows: list[int] = []
    columns: list[int] = []
    values: list[float] = []
    for row, p in enumerate(params):
        if p.logit_bias:
            rows.extend([row] * len(p.logit_bias))
            columns.extend(p.logit_bias.keys())
            values.extend(p.logit_bias.values())
    if not rows:
        return
    if max(columns) >= logits.shape[1]:
        raise ValueError(
            f"logit_bias names token {max(columns)} beyond the vocabulary of {logits.shape[1]}"
        )
    device = logits.device
    index = (torch.tensor(rows, device=device), torch.tensor(columns, device=device))
    logits.index_put_(
        index, torch.tensor(values, dtype=logits.dtype, device=device), accumulate=True
    )


def _token_counts(
    histories: Sequence[Sequence[int]], rows: Sequence[int], vocab_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct (row, token) pairs of the histories as flat ids row * vocab_size + token, and
    their counts.

    `histories[j]` belongs to row `rows[j]`. Costs time in the history length, not the vocabulary.
    """
    token_ids = torch.tensor(
        list(itertools.chain.from_iterable(histories)), dtype=torch.long, device=device
    )
    if token_ids.numel() and (int(token_ids.min()) < 0 or int(token_ids.max()) >= vocab_size):
        raise ValueError(f"token history holds an id outside [0, {vocab_size})")
    lengths = torch.tensor([len(h) for h in histories], device=device)
    row_ids = torch.repeat_interleave(
        torch.tensor(list(rows), dtype=torch.long, device=device), lengths
    )
    return torch.unique(row_ids * vocab_size + token_ids, return_counts=True)


def apply_penalties(
    logits: torch.Tensor, requests: Sequence[PenalisedRow], rows: Sequence[int]
) -> None:
    """Repetition (prompt and output), then presence and frequency (output only) penalties, in
    place.

    `requests[j]` is row `rows[j]` of `logits` ([rows, vocab], contiguous); only logits of tokens
    in a history are read or written.
    """
    vocab_size, device = logits.shape[1], logits.device
    flat = logits.view(-1)
    output_ids, output_counts = _token_counts(
        [r.output_token_ids for r in requests], rows, vocab_size, device
    )

    def per_row(values: list[float], flat_ids: torch.Tensor) -> torch.Tensor:
        by_row = torch.zeros(logits.shape[0], dtype=logits.dtype, device=device)
        by_row[list(rows)] = torch.tensor(values, dtype=logits.dtype, device=device)
        return by_row[flat_ids // vocab_size]

    repetition = [r.params.repetition_penalty for r in requests]
    if any(p != 1.0 for p in repetition):
        prompt_ids, _ = _token_counts(
            [r.prompt_token_ids for r in requests], rows, vocab_size, device
        )
        seen = torch.unique(torch.cat([prompt_ids, output_ids]))
        penalty, values = per_row(repetition, seen), flat[seen]
        flat[seen] = torch.where(values > 0, values / penalty, values * penalty)
    presence = per_row([r.params.presence_penalty for r in requests], output_ids)
    frequency = per_row([r.params.frequency_penalty for r in requests], output_ids)
    flat[output_ids] = flat[output_ids] - (presence + frequency * output_counts.to(logits.dtype))
