"""Perplexity of a decoder over a token stream, with a sliding window.

The first window reads the first `context` tokens and scores all of them but the first. Every
later window scores the next `stride` tokens, reading them together with the tokens just before
them, `context` in all. So every token after the first is predicted exactly once, with at least
`context - stride` tokens of history; stride = context - 1 makes windows nearly disjoint (fastest),
a smaller stride gives each prediction more history.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from rebar.errors import InvalidRequestError
from rebar.model.tokenizer import Tokenizer
from rebar.quant.calib_data import JsonlDataset

DOCUMENT_SEPARATOR = "\n\n"


@dataclass(frozen=True)
class Window:
    begin: int  # first token fed to the model
    end: int  # one past the last token fed
    first_target: int  # first token scored; every token in [first_target, end) is scored here


def sliding_windows(num_tokens: int, context: int, stride: int) -> list[Window]:
    """Windows covering targets 1..num_tokens-1, each exactly once."""
    if context < 2:
        raise InvalidRequestError(f"context must be at least 2 tokens, got {context}", "context")
    if not 1 <= stride < context:
        raise InvalidRequestError(
            "stride must be at least 1 and less than the context "
            f"({context}), so every scored token has history; got {stride}",
            "stride",
        )
    if num_tokens < 2:
        raise InvalidRequestError(f"perplexity needs at least 2 tokens, got {num_tokens}", "data")
    windows = [Window(0, min(context, num_tokens), 1)]
    while windows[-1].end < num_tokens:
        scored_until = windows[-1].end
        end = min(scored_until + stride, num_tokens)
        windows.append(Window(end - context, end, scored_until))
    return windows


@dataclass(frozen=True)
class PerplexityResult:
    perplexity: float
    mean_nll: float  # nats per scored token
    num_scored: int
    num_windows: int
    context: int
    stride: int
    seconds: float


def perplexity(
    logits_of: Callable[[list[int]], torch.Tensor],
    token_ids: Sequence[int],
    context: int,
    stride: int,
) -> PerplexityResult:
    """`logits_of(ids)` must return next-token logits [len(ids), vocab] (row i predicts
    ids[i + 1])."""
    started = time.perf_counter()
    ids = list(token_ids)
    windows = sliding_windows(len(ids), context, stride)
    total_nll = 0.0
    num_scored = 0
    for window in windows:
        logits = logits_of(ids[window.begin : window.end])
        rows = logits[
            window.first_target - 1 - window.begin : window.end - 1 - window.begin
        ].float()
        targets = torch.tensor(ids[window.first_target : window.end], dtype=torch.long)
        total_nll += F.cross_entropy(rows, targets, reduction="sum").item()
        num_scored += len(targets)
    mean_nll = total_nll / num_scored
    return PerplexityResult(
        math.exp(mean_nll),
        mean_nll,
        num_scored,
        len(windows),
        context,
        stride,
        time.perf_counter() - started,
    )


def read_text(path: Path, text_field: str = "text") -> str:
    """A .jsonl file's texts joined by blank lines (bad lines reported and skipped); any other file
    as UTF-8 text."""
    if path.suffix == ".jsonl":
        with JsonlDataset(path, text_field) as dataset:
            return DOCUMENT_SEPARATOR.join(dataset.texts())
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError as exc:
        raise InvalidRequestError(f"data file {path} does not exist", "data") from exc
    except UnicodeDecodeError as exc:
        raise InvalidRequestError(f"data file {path} is not UTF-8 text: {exc}", "data") from exc


def evaluation_tokens(
    tokenizer: Tokenizer, path: Path, text_field: str = "text", max_tokens: int | None = None
) -> list[int]:
    """The token stream of a data file, cut to its first `max_tokens` tokens."""
    if max_tokens is not None and max_tokens < 2:
        raise InvalidRequestError(f"max_tokens must be at least 2, got {max_tokens}", "max_tokens")
    ids = tokenizer.encode(read_text(path, text_field))
    return ids if max_tokens is None else ids[:max_tokens]
