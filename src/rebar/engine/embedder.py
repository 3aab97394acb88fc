"""Embeddings from an encoder (BERT) model: texts in, L2-normalised vectors out, in batches."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rebar.errors import InvalidRequestError
from rebar.model.bert import BertModel
from rebar.model.tokenizer import Tokenizer

Input = str | Sequence[int]  # a text, or the token ids the model reads as they are


class Embedder:
    """One vector per input from `model`: texts are tokenized (those past the model's window
    truncated by the tokenizer: callers that must refuse them count tokens first); token-id inputs
    are read as given, and must fit the window (`max_input_tokens`)."""

    def __init__(self, model: BertModel, tokenizer: Tokenizer, device: torch.device) -> None:
        self.model, self.tokenizer, self.device = model, tokenizer, device
        self.dimensions = model.config.hidden_size
        self.max_input_tokens = model.config.max_seq_length
        self.vocab_size = min(tokenizer.vocab_size, model.config.vocab_size)

    def embed(self, texts: Sequence[Input], batch_size: int = 32) -> torch.Tensor:
        """float32 [len(texts), dimensions]; raises InvalidRequestError for anything but a
        non-empty list of strings or token-id lists."""
        if (
            isinstance(texts, str)
            or not isinstance(texts, Sequence)
            or not texts
            or not all(_is_input(t, self.max_input_tokens, self.vocab_size) for t in texts)
        ):
            raise InvalidRequestError(
                "input must be a non-empty list of strings or of token-id lists (ids below "
                f"{self.vocab_size}) that fit the model's {self.max_input_tokens} tokens",
                "input",
            )
        texts = list(texts)
        chunks = [self._batch(texts[i : i + batch_size]) for i in range(0, len(texts), batch_size)]
        return torch.cat(chunks)

    @torch.inference_mode()
    def _batch(self, inputs: list[Input]) -> torch.Tensor:
        texts = [t for t in inputs if isinstance(t, str)]
        from_texts = iter(self.tokenizer.encode_batch(texts, add_special_tokens=True))
        encoded = [next(from_texts) if isinstance(t, str) else list(t) for t in inputs]
        width = max(len(ids) for ids in encoded)
        input_ids = torch.zeros(len(encoded), width, dtype=torch.long)
        mask = torch.zeros(len(encoded), width, dtype=torch.long)
        for row, ids in enumerate(encoded):
            input_ids[row, : len(ids)] = torch.tensor(ids)
            mask[row, : len(ids)] = 1
        return self.model.embed(input_ids.to(self.device), mask.to(self.device)).cpu()


def _is_input(value: object, max_tokens: int, vocab_size: int) -> bool:
    if isinstance(value, str):
        return True
    return (
        isinstance(value, Sequence)
        and 0 < len(value) <= max_tokens
        and all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab_size for i in value
        )
    )
