"""Embeddings from an encoder (BERT) model: texts in, L2-normalised vectors out, in batches."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rebar.errors import InvalidRequestError
from rebar.model.bert import BertModel
from rebar.model.tokenizer import Tokenizer


class Embedder:
    """One vector per text from `model`; inputs past the model's window are truncated by the
    tokenizer (callers that must refuse them count tokens first)."""

    def __init__(self, model: BertModel, tokenizer: Tokenizer, device: torch.device) -> None:
        self.model, self.tokenizer, self.device = model, tokenizer, device
        self.dimensions = model.config.hidden_size

    def embed(self, texts: Sequence[str], batch_size: int = 32) -> torch.Tensor:
        """float32 [len(texts), dimensions]; raises InvalidRequestError for anything but a
        non-empty list of strings."""
        if (
            isinstance(texts, str)
            or not isinstance(texts, Sequence)
            or not texts
            or not all(isinstance(t, str) for t in texts)
        ):
            raise InvalidRequestError("input must be a non-empty list of strings", "input")
        texts = list(texts)
        chunks = [self._batch(texts[i : i + batch_size]) for i in range(0, len(texts), batch_size)]
        return torch.cat(chunks)

    @torch.inference_mode()
    def _batch(self, texts: list[str]) -> torch.Tensor:
        encoded = self.tokenizer.encode_batch(texts, add_special_tokens=True)
        width = max(len(ids) for ids in encoded)
        input_ids = torch.zeros(len(encoded), width, dtype=torch.long)
        mask = torch.zeros(len(encoded), width, dtype=torch.long)
        for row, ids in enumerate(encoded):
            input_ids[row, : len(ids)] = torch.tensor(ids)
            mask[row, : len(ids)] = 1
        return self.model.embed(input_ids.to(self.device), mask.to(self.device)).cpu()
