"""A model's text side without its weights: tokenizer, chat template, context window. What a front
end needs to turn requests into token ids when the model itself runs in another process."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rebar.engine.prompt import with_bos
from rebar.errors import InvalidRequestError
from rebar.model.chat_prompt import chat_prompt_ids
from rebar.model.loader import Checkpoint, open_checkpoint

Messages = Sequence[Mapping[str, Any]]


class ModelText:
    """The tokenizer and chat template of `checkpoint` (metadata only: no weights are read)."""

    load_seconds: float = 0.0  # of the whole model, wherever it loaded
    dtype: object = "unknown"  # of its weights: a torch.dtype, or its name

    def __init__(self, checkpoint: Checkpoint, max_model_len: int | None = None) -> None:
        self.checkpoint = checkpoint
        self.config = checkpoint.config
        self.tokenizer = checkpoint.tokenizer
        self._max_model_len = max_model_len

    @classmethod
    def open(cls, model: str | Path, max_model_len: int | None) -> ModelText:
        return cls(open_checkpoint(model), max_model_len)

    @property
    def max_model_len(self) -> int:
        if self._max_model_len is None:
            raise self.not_a_decoder()
        return self._max_model_len

    def not_a_decoder(self) -> InvalidRequestError:
        return InvalidRequestError(
            f"{self.config.source_architecture} is an embedding model; it cannot generate", "model"
        )

    def tokenize(self, text: str) -> list[int]:
        """Token ids of `text`; no BOS is added and special tokens in the text are parsed."""
        if not isinstance(text, str):
            raise InvalidRequestError("text to tokenize must be a string", "text")
        return self.tokenizer.encode(text)

    def detokenize(self, ids: Sequence[int]) -> str:
        vocab = self.tokenizer.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in ids):
            raise InvalidRequestError(f"token ids must be integers in [0, {vocab})", "tokens")
        return self.tokenizer.decode(ids)

    def chat_prompt_ids(
        self,
        messages: Messages,
        add_generation_prompt: bool = True,
        bos: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        """Token ids of `messages` in the model's own chat template, message contents kept as text
        (a typed `<|im_start|>` never becomes a control token); led by BOS when the model wants one
        and `bos` is True."""
        ids = chat_prompt_ids(
            self.tokenizer, self.checkpoint.chat_template, messages, add_generation_prompt, tools
        )
        return with_bos(self.tokenizer, ids) if bos else ids
