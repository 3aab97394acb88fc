"""The offline Python API: `LLM(model=...)` with tokenize, logits, generate, chat and embed.

Generation runs on the same EngineCore as the server (continuous batching, paged KV cache,
prefix caching), stepped synchronously in the calling thread.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import cast

import torch

from rebar.engine.core import EngineCore
from rebar.engine.engine_config import DTYPE_NAMES, EngineConfig, torch_dtype
from rebar.engine.model_text import Messages, ModelText
from rebar.engine.outputs import CompletionOutput, OutputAccumulator, RequestOutput
from rebar.engine.prompt import Prompt, prompt_token_ids
from rebar.engine.request import AdmittedRequest
from rebar.engine.sampling_params import SamplingParams
from rebar.errors import ConfigError, InvalidRequestError
from rebar.model.bert import BertModel
from rebar.model.build import build_model
from rebar.model.footprint import tensor_bytes
from rebar.model.loader import open_checkpoint


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device {device!r} requested but CUDA is not available")
    try:
        return torch.device(device)
    except RuntimeError:
        raise ConfigError(
            f"invalid device {device!r}; allowed: auto, cpu, mps, cuda or cuda:N"
        ) from None


def resolve_dtype(dtype: str) -> torch.dtype:
    if dtype not in DTYPE_NAMES:
        raise ConfigError(f"invalid dtype {dtype!r}; allowed: one of {', '.join(DTYPE_NAMES)}")
    return torch_dtype(dtype)


class LLM(ModelText):
    """A loaded model. Decoder models generate; encoder (BERT) models embed.

    Quantized weights (rebar's quantized checkpoints, GGUF block types) stay quantized in memory and
    run on rebar's CPU kernels, where those exist for the device; `dequantize=True` expands
    everything to `dtype` (the float reference).
    Everything is synchronous and runs in the calling thread.
    """

    def __init__(
        self,
        model: str | Path = "smollm2",
        dtype: str = "float32",
        device: str = "auto",
        max_model_len: int | None = None,
        engine_config: EngineConfig | None = None,
        dequantize: bool = False,
        memory_budget: int | None = None,
    ) -> None:
        """`memory_budget` (bytes) bounds weights + KV cache: the KV cache gets what the weights
        leave (overriding the engine config's own sizing); a model that cannot fit raises
        ConfigError with the numbers."""
        started = time.perf_counter()
        self.device = resolve_device(device)  # settings first: a bad one fails before the load
        self.dtype = resolve_dtype(dtype)
        engine_config = engine_config or EngineConfig()
        if max_model_len is not None:
            engine_config = replace(engine_config, max_model_len=max_model_len)
        super().__init__(open_checkpoint(model))
        self.model = build_model(
            self.checkpoint,
            self.dtype,
            self.device,
            attention_backend=engine_config.attention_backend,
            dequantize=dequantize,
        )
        self.weight_bytes = tensor_bytes(self.model)
        if memory_budget is not None:
            engine_config = replace(
                engine_config, kv_cache_memory=self._kv_left(memory_budget, model)
            )
        self.engine: EngineCore | None = None
        if self.config.is_decoder:
            try:
                self.engine = EngineCore(
                    self.model, self.config, self.tokenizer, engine_config, self.dtype, self.device
                )
            except InvalidRequestError as exc:
                if memory_budget is None:
                    raise
                raise ConfigError(
                    f"{model}: a memory budget of {_mib(memory_budget)} leaves "
                    f"{_mib(memory_budget - self.weight_bytes)} for the KV cache after "
                    f"{_mib(self.weight_bytes)} of weights; "
                    + str(exc).replace("raise kv_cache_memory", "raise the memory budget")
                ) from None
        self.load_seconds = time.perf_counter() - started
        self._ids = itertools.count()

    def _kv_left(self, memory_budget: int, model: str | Path) -> int:
        left = memory_budget - self.weight_bytes
        if left <= 0 or (self.config.is_decoder and left < 2**20):
            raise ConfigError(
                f"{model}: its weights take {_mib(self.weight_bytes)}, leaving no room for a KV "
                f"cache in its memory budget of {_mib(memory_budget)}"
            )
        return left

    @property
    def kv_cache_bytes(self) -> int:
        return 0 if self.engine is None else self.engine.runner.kv_cache.num_bytes

    @property
    def footprint_bytes(self) -> int:
        """What this model holds: its weights and its KV cache."""
        return self.weight_bytes + self.kv_cache_bytes

    @property
    def max_model_len(self) -> int:
        return self._require_decoder().max_model_len

    # ----- decoder models -----------------------------------------------------------------
    def _require_decoder(self) -> EngineCore:
        if self.engine is None:
            raise self.not_a_decoder()
        return self.engine

    def logits(self, ids: Sequence[int]) -> torch.Tensor:
        """Teacher-forced next-token logits: float32 [len(ids), vocab], row i predicts token
        i + 1."""
        engine = self._require_decoder()
        ids = list(ids)
        vocab = self.tokenizer.vocab_size
        if not ids or any(not isinstance(t, int) or not 0 <= t < vocab for t in ids):
            raise InvalidRequestError(
                f"need a non-empty list of token ids in [0, {vocab})", "prompt"
            )
        if len(ids) > engine.max_model_len:
            raise InvalidRequestError(
                f"{len(ids)} tokens exceed the context window of {engine.max_model_len}", "prompt"
            )
        return engine.logits(ids)

    def stream(
        self,
        prompts: Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> Iterator[RequestOutput]:
        """Generate for every prompt as one continuous batch, yielding outputs as each step produces
        them.

        Outputs carry `request_id` = the prompt's position as a string. Every prompt is checked
        before any starts (InvalidRequestError names the parameter). Stopping the iteration early
        aborts what is still running.
        """
        return self._run(self._admit(prompts, params))

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[CompletionOutput]:
        """Complete each prompt (text, or a list of token ids); returns one output per prompt, in
        order."""
        admitted = self._admit(self._as_batch(prompts), params)
        collected = [OutputAccumulator() for _ in admitted]
        for output in self._run(admitted):
            collected[int(output.request_id)].add(output)
        return [
            CompletionOutput.from_outputs(list(request.prompt_token_ids), outputs)
            for request, outputs in zip(admitted, collected)
        ]

    def _admit(
        self,
        prompts: Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None,
    ) -> list[AdmittedRequest]:
        """The offline front door: each prompt tokenized and checked once, before any is queued."""
        engine = self._require_decoder()
        per_prompt = self._params_per_prompt(params, len(prompts))
        return [
            engine.admit(prompt_token_ids(self.tokenizer, prompt), sp)
            for prompt, sp in zip(prompts, per_prompt)
        ]

    def _run(self, admitted: list[AdmittedRequest]) -> Iterator[RequestOutput]:
        engine = self._require_decoder()
        request_ids = [f"llm-{next(self._ids)}" for _ in admitted]
        names = {rid: str(i) for i, rid in enumerate(request_ids)}
        try:
            for rid, request in zip(request_ids, admitted):
                engine.add_admitted(rid, request)
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if output.request_id in names:
                        yield _renamed(output, names[output.request_id])
        finally:
            for rid in request_ids:
                engine.abort_request(rid)

    def chat(
        self, conversations: Messages | Sequence[Messages], params: SamplingParams | None = None
    ) -> list[CompletionOutput]:
        """Answer one conversation (a list of messages) or several; renders the model's own
        template."""
        single = bool(conversations) and isinstance(conversations[0], Mapping)
        batch = cast(Sequence[Messages], [conversations] if single else conversations)
        return self.generate([self.chat_prompt_ids(c) for c in batch], params)

    @staticmethod
    def _as_batch(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
        if isinstance(prompts, str):
            return [prompts]
        batch = list(prompts)
        if not batch:
            raise InvalidRequestError("no prompts given", "prompt")
        if all(isinstance(t, int) for t in batch):
            return [cast(list[int], batch)]  # one prompt given as token ids
        return cast(list[Prompt], batch)

    @staticmethod
    def _params_per_prompt(
        params: SamplingParams | Sequence[SamplingParams] | None, count: int
    ) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams()] * count
        if isinstance(params, SamplingParams):
            return [params] * count
        if len(params) != count:
            raise InvalidRequestError(
                f"got {len(params)} SamplingParams for {count} prompts", "params"
            )
        return list(params)

    # ----- encoder models -----------------------------------------------------------------
    def embed(self, texts: str | Sequence[str], batch_size: int = 32) -> torch.Tensor:
        """One L2-normalised vector per text (float32 [len(texts), hidden]); inputs past the limit
        are truncated."""
        if self.config.architecture != "bert":
            raise InvalidRequestError(
                f"{self.config.source_architecture} is not an embedding model", "model"
            )
        if isinstance(texts, str):
            texts = [texts]
        if (
            not isinstance(texts, Sequence)
            or not texts
            or not all(isinstance(t, str) for t in texts)
        ):
            raise InvalidRequestError("input must be a non-empty list of strings", "input")
        texts = list(texts)
        chunks = [
            self._embed_batch(texts[i : i + batch_size]) for i in range(0, len(texts), batch_size)
        ]
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
        assert isinstance(self.model, BertModel), "embed() checked the architecture"
        return self.model.embed(input_ids.to(self.device), mask.to(self.device)).cpu()


def _renamed(output: RequestOutput, request_id: str) -> RequestOutput:
    return replace(output, request_id=request_id)


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:,.1f} MiB"
