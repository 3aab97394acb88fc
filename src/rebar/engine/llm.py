"""The offline Python API: `LLM(model=...)` with tokenize, logits, generate, chat and embed."""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from rebar.engine.outputs import CompletionOutput, StepOutput
from rebar.engine.sampling_params import SamplingParams
from rebar.engine.static_runner import StaticBatchRunner
from rebar.errors import InvalidRequestError
from rebar.model.build import build_model
from rebar.model.chat_template import render_chat
from rebar.model.loader import open_checkpoint

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

Prompt = str | list[int]
Messages = Sequence[Mapping[str, Any]]


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise InvalidRequestError(f"device {device!r} requested but CUDA is not available", "device")
    return torch.device(device)


def resolve_dtype(dtype: str) -> torch.dtype:
    if dtype not in _DTYPES:
        raise InvalidRequestError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}", "dtype")
    return _DTYPES[dtype]


class LLM:
    """A loaded model. Decoder models generate; encoder (BERT) models embed.

    Everything is synchronous and runs in the calling thread; the serving engine builds on the
    same model and tokenizer objects.
    """

    def __init__(self, model: str | Path = "smollm2", dtype: str = "float32", device: str = "auto", max_model_len: int | None = None) -> None:
        started = time.perf_counter()
        self.checkpoint = open_checkpoint(model)
        self.config = self.checkpoint.config
        self.tokenizer = self.checkpoint.tokenizer
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype)
        self.model = build_model(self.checkpoint, self.dtype, self.device)
        limit = self.config.max_position_embeddings
        if max_model_len is not None and not 0 < max_model_len <= limit:
            raise InvalidRequestError(f"max_model_len must be in [1, {limit}], got {max_model_len}", "max_model_len")
        self.max_model_len = max_model_len or limit
        self.load_seconds = time.perf_counter() - started
        self._runner = None
        if self.config.is_decoder:
            self._runner = StaticBatchRunner(
                self.model, self.config, self.tokenizer, self.max_model_len, self.dtype, self.device
            )

    # ----- text <-> ids -------------------------------------------------------------------
    def tokenize(self, text: str) -> list[int]:
        """Token ids of `text`; no BOS is added and special tokens in the text are parsed."""
        if not isinstance(text, str):
            raise InvalidRequestError("text to tokenize must be a string", "text")
        return self.tokenizer.encode(text)

    def detokenize(self, ids: Sequence[int]) -> str:
        self._check_ids(ids, allow_empty=True)
        return self.tokenizer.decode(ids)

    def _check_ids(self, ids: Sequence[int], allow_empty: bool = False, param: str = "prompt") -> list[int]:
        ids = list(ids)
        if not ids and not allow_empty:
            raise InvalidRequestError("token id list is empty", param)
        vocab = self.tokenizer.vocab_size
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"token ids out of range [0, {vocab}): {bad[:5]}", param)
        return ids

    # ----- decoder models -----------------------------------------------------------------
    def _require_decoder(self) -> StaticBatchRunner:
        if self._runner is None:
            raise InvalidRequestError(f"{self.config.source_architecture} is an embedding model; it cannot generate", "model")
        return self._runner

    def logits(self, ids: Sequence[int]) -> torch.Tensor:
        """Teacher-forced next-token logits: float32 [len(ids), vocab], row i predicts token i + 1."""
        runner = self._require_decoder()
        ids = self._check_ids(ids)
        if len(ids) > self.max_model_len:
            raise InvalidRequestError(f"{len(ids)} tokens exceed the context window of {self.max_model_len}", "prompt")
        cache = runner.new_cache(-(-len(ids) // runner.block_size))
        hidden = runner.forward(cache, [(ids, 0, 0)])
        with torch.inference_mode():
            return self.model.compute_logits(hidden).cpu()

    def prompt_ids(self, prompt: Prompt) -> list[int]:
        """Ids the model sees for `prompt`: text is tokenized and gets BOS when the model wants one."""
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
            bos = self.tokenizer.special.bos_token_id
            if self.tokenizer.special.add_bos and bos is not None and (not ids or ids[0] != bos):
                ids.insert(0, bos)
        else:
            ids = self._check_ids(prompt)
        if not ids:
            raise InvalidRequestError("prompt is empty", "prompt")
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {len(ids)} tokens; the context window of {self.max_model_len} leaves no room to generate",
                "prompt",
            )
        return ids

    def stream(self, prompts: Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None = None) -> Iterator[StepOutput]:
        """Generate for every prompt, yielding each token as it is produced (all prompts run as one batch)."""
        runner = self._require_decoder()
        prompt_ids = [self.prompt_ids(p) for p in prompts]
        per_prompt = self._params_per_prompt(params, len(prompt_ids))
        for ids, sp in zip(prompt_ids, per_prompt):
            if sp.max_tokens is not None and len(ids) + sp.max_tokens > self.max_model_len:
                raise InvalidRequestError(
                    f"prompt ({len(ids)} tokens) + max_tokens ({sp.max_tokens}) exceeds the context window of "
                    f"{self.max_model_len}",
                    "max_tokens",
                )
        return runner.run(prompt_ids, per_prompt)

    def generate(self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[CompletionOutput]:
        """Complete each prompt (text, or a list of token ids); returns outputs in prompt order."""
        batch = self._as_batch(prompts)
        prompt_ids = [self.prompt_ids(p) for p in batch]
        texts = [""] * len(batch)
        tokens: list[list[int]] = [[] for _ in batch]
        finished: dict[int, StepOutput] = {}
        for step in self.stream(prompt_ids, params):
            texts[step.index] += step.text_delta
            tokens[step.index].append(step.token_id)
            if step.finish_reason is not None:
                finished[step.index] = step
        return [
            CompletionOutput(prompt_ids[i], texts[i], tokens[i], finished[i].finish_reason, finished[i].stop_reason)
            for i in range(len(batch))
        ]

    def render_chat(self, messages: Messages, add_generation_prompt: bool = True) -> str:
        special = self.tokenizer.special
        return render_chat(self.checkpoint.chat_template, messages, add_generation_prompt, special.bos_token, special.eos_token)

    def chat(self, conversations: Messages | Sequence[Messages], params: SamplingParams | None = None) -> list[CompletionOutput]:
        """Answer one conversation (a list of messages) or several; renders the model's own template."""
        if conversations and isinstance(conversations[0], Mapping):
            conversations = [conversations]  # a single conversation
        return self.generate([self.render_chat(c) for c in conversations], params)

    @staticmethod
    def _as_batch(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
        if isinstance(prompts, str):
            return [prompts]
        batch = list(prompts)
        if batch and all(isinstance(t, int) for t in batch):
            return [batch]  # one prompt given as token ids
        if not batch:
            raise InvalidRequestError("no prompts given", "prompt")
        return batch

    @staticmethod
    def _params_per_prompt(params: SamplingParams | Sequence[SamplingParams] | None, count: int) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams()] * count
        if isinstance(params, SamplingParams):
            return [params] * count
        if len(params) != count:
            raise InvalidRequestError(f"got {len(params)} SamplingParams for {count} prompts", "params")
        return list(params)

    # ----- encoder models -----------------------------------------------------------------
    def embed(self, texts: str | Sequence[str], batch_size: int = 32) -> torch.Tensor:
        """One L2-normalised vector per text (float32 [len(texts), hidden]); inputs past the limit are truncated."""
        if self.config.architecture != "bert":
            raise InvalidRequestError(f"{self.config.source_architecture} is not an embedding model", "model")
        if isinstance(texts, str):
            texts = [texts]
        if not isinstance(texts, Sequence) or not texts or not all(isinstance(t, str) for t in texts):
            raise InvalidRequestError("input must be a non-empty list of strings", "input")
        texts = list(texts)
        chunks = [self._embed_batch(texts[i : i + batch_size]) for i in range(0, len(texts), batch_size)]
        return torch.cat(chunks)

    @torch.inference_mode()
    def _embed_batch(self, texts: list[str]) -> torch.Tensor:
        encoded = self.tokenizer.encode_batch(texts, add_special_tokens=True)
        width = max(len(ids) for ids in encoded)
        input_ids = torch.zeros(len(encoded), width, dtype=torch.long)
        mask = torch.zeros(len(encoded), width, dtype=torch.long)
        for row, ids in enumerate(encoded):
            input_ids[row, : len(ids)] = torch.tensor(ids)
            mask[row, : len(ids)] = 1
        return self.model.embed(input_ids.to(self.device), mask.to(self.device)).cpu()
