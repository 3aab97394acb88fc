"""The offline Python API: `LLM(model=...)` with tokenize, logits, generate, chat and embed.

Generation runs on the same EngineCore as the server (continuous batching, paged KV cache,
prefix caching), stepped synchronously in the calling thread. The model is loaded by the engine's
one builder (`rebar.engine.builder`); engine settings are given as keyword arguments and checked
against their one definition (`rebar.config.EngineSettings`), as a settings file would be.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import torch

from rebar.config import EngineSettings, Settings, check_engine_settings
from rebar.engine import run
from rebar.engine.builder import LoadedModel, load_model
from rebar.engine.core import EngineCore
from rebar.engine.engine_config import EngineConfig
from rebar.engine.model_text import Messages, ModelText
from rebar.engine.outputs import CompletionOutput, RequestOutput
from rebar.engine.prompt import Prompt, prompt_token_ids
from rebar.engine.request import AdmittedRequest
from rebar.engine.sampling_params import SamplingParams
from rebar.errors import InvalidRequestError


class LLM(ModelText):
    """A loaded model. Decoder models generate; encoder (BERT) models embed.

    Quantized weights (rebar's quantized checkpoints, GGUF block types) stay quantized in memory and
    run on rebar's CPU kernels, where those exist for the device; `dequantize=True` expands
    everything to `dtype` (the float reference). Everything is synchronous and runs in the calling
    thread.
    """

    def __init__(
        self,
        model: str | Path = "smollm2",
        dtype: str = "float32",
        device: str = "auto",
        dequantize: bool = False,
        memory_budget: int | None = None,
        engine_config: EngineConfig | None = None,
        **engine: Any,
    ) -> None:
        """`engine` holds `[engine]` settings by name (`max_model_len=512, block_size=8`), checked
        before anything loads (ConfigError naming the setting); `engine_config` gives them all at
        once instead. `memory_budget` (bytes) bounds weights + KV cache: the KV cache gets what the
        weights leave; a model that cannot fit raises ConfigError with the numbers."""
        if engine_config is not None and engine:
            raise InvalidRequestError("give engine_config or engine settings, not both", "engine")
        if engine_config is None:
            settings = check_engine_settings(engine, "in LLM(...) arguments")
            engine_config = EngineConfig(**settings.engine_fields())
        self.loaded: LoadedModel = load_model(
            model, dtype, device, engine_config, dequantize, memory_budget
        )
        super().__init__(self.loaded.text.checkpoint, self.loaded.text._max_model_len)
        self.model = self.loaded.model
        self.engine: EngineCore | None = self.loaded.engine
        self.device, self.dtype = self.loaded.device, self.loaded.dtype
        self.weight_bytes = self.loaded.weight_bytes
        self.load_seconds = self.loaded.load_seconds

    @classmethod
    def from_settings(cls, model: str | Path, settings: Settings) -> LLM:
        """`model` loaded as the settings say: [models] dtype, device and dequantize, the [engine]
        settings, and `engine.num_threads` applied to torch (a process-wide setting)."""
        if settings.engine.num_threads:
            torch.set_num_threads(settings.engine.num_threads)
        m = settings.models
        return cls(
            model,
            dtype=m.dtype,
            device=m.device,
            dequantize=m.dequantize,
            engine_config=EngineConfig(**settings.engine.engine_fields()),
        )

    @property
    def kv_cache_bytes(self) -> int:
        return self.loaded.kv_cache_bytes

    @property
    def footprint_bytes(self) -> int:
        """What this model holds: its weights and its KV cache."""
        return self.loaded.footprint_bytes

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
        return run.stream(self._require_decoder(), self._admit(prompts, params))

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[CompletionOutput]:
        """Complete each prompt (text, or a list of token ids); returns one output per prompt, in
        order."""
        admitted = self._admit(self._as_batch(prompts), params)
        return run.complete(self._require_decoder(), admitted)

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
        embedder = self.loaded.embedder
        if embedder is None:
            raise InvalidRequestError(
                f"{self.config.source_architecture} is not an embedding model", "model"
            )
        return embedder.embed([texts] if isinstance(texts, str) else texts, batch_size)


def engine_config(**engine: Any) -> EngineConfig:
    """An EngineConfig from the default `[engine]` settings and `engine` (checked as `LLM`'s
    keyword arguments are)."""
    settings: EngineSettings = check_engine_settings(engine, "in engine_config(...) arguments")
    return EngineConfig(**settings.engine_fields())
