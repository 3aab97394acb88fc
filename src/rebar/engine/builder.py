"""Loading a model to run: its weights built for a device within a memory budget, then the engine
core of a decoder or the embedder of an encoder.

The one builder behind the offline `rebar.LLM`, the server's engine thread and the engine process
(`rebar.engine.engine_process`): each loads a model the same way, from the same plain values.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from rebar.dtypes import DTYPE_NAMES
from rebar.engine.core import EngineCore
from rebar.engine.embedder import Embedder
from rebar.engine.engine_config import EngineConfig, torch_dtype
from rebar.engine.model_text import ModelText
from rebar.engine.spec.draft_model import DraftModel, check_same_vocabulary
from rebar.errors import ConfigError, InvalidRequestError
from rebar.model.bert import BertModel
from rebar.model.build import build_model
from rebar.model.footprint import tensor_bytes
from rebar.model.loader import open_checkpoint
from rebar.model.loader.base import Checkpoint


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


@dataclass(eq=False)
class LoadedModel:
    """A model ready to run: a decoder's engine core (`engine`) or an encoder's `embedder`, never
    both.

    `weight_bytes` is what its tensors hold (the repacked kernel operands included);
    `footprint_bytes` adds the KV cache.
    """

    text: ModelText
    model: nn.Module
    device: torch.device
    dtype: torch.dtype
    weight_bytes: int
    load_seconds: float
    engine: EngineCore | None = None
    embedder: Embedder | None = None
    draft: DraftModel | None = None  # the draft model speculative decoding drafts with

    @property
    def checkpoint(self):
        return self.text.checkpoint

    @property
    def kv_cache_bytes(self) -> int:
        return 0 if self.engine is None else self.engine.runner.kv_cache.num_bytes

    @property
    def footprint_bytes(self) -> int:
        return self.weight_bytes + self.kv_cache_bytes


def load_model(
    model: str | Path,
    dtype: str,
    device: str,
    engine_config: EngineConfig,
    dequantize: bool = False,
    memory_budget: int | None = None,
) -> LoadedModel:
    """Load `model` (an alias, a .gguf file or an HF folder).

    `memory_budget` (bytes) bounds weights + KV cache: the KV cache gets what the weights leave
    (overriding the engine config's own sizing); a model that cannot fit raises ConfigError with
    the numbers. Raises ConfigError for a bad device or dtype before reading any weights.
    """
    started = time.perf_counter()
    torch_device = resolve_device(device)  # settings first: a bad one fails before the load
    torch_dtype_ = resolve_dtype(dtype)
    checkpoint = open_checkpoint(model)
    draft_checkpoint = _draft_checkpoint(checkpoint, engine_config)  # before any weight loads
    module = build_model(
        checkpoint,
        torch_dtype_,
        torch_device,
        attention_backend=engine_config.attention_backend,
        dequantize=dequantize,
    )
    weight_bytes = tensor_bytes(module)
    config = checkpoint.config
    loaded = LoadedModel(
        ModelText(checkpoint), module, torch_device, torch_dtype_, weight_bytes, 0.0
    )
    if draft_checkpoint is not None:
        loaded.draft = _draft(draft_checkpoint, engine_config, torch_dtype_, torch_device)
        loaded.weight_bytes += tensor_bytes(loaded.draft.model)
    if not config.is_decoder:
        assert isinstance(module, BertModel), "every encoder rebar builds is a BertModel"
        if memory_budget is not None and weight_bytes > memory_budget:
            raise ConfigError(
                f"{model}: its weights take {_mib(weight_bytes)}, more than its memory budget of "
                f"{_mib(memory_budget)}"
            )
        loaded.embedder = Embedder(module, checkpoint.tokenizer, torch_device)
    else:
        if memory_budget is not None:
            kv_left = _kv_left(memory_budget, loaded.weight_bytes, model)
            engine_config = replace(engine_config, kv_cache_memory=kv_left)
        loaded.engine = _engine_core(loaded, engine_config, memory_budget, model)
        loaded.text = ModelText(checkpoint, loaded.engine.max_model_len)
    loaded.load_seconds = time.perf_counter() - started
    # What the text side reports of the whole model (metrics read it beside the tokenizer).
    loaded.text.load_seconds, loaded.text.dtype = loaded.load_seconds, torch_dtype_
    return loaded


def _engine_core(
    loaded: LoadedModel,
    engine_config: EngineConfig,
    memory_budget: int | None,
    model: str | Path,
) -> EngineCore:
    checkpoint = loaded.text.checkpoint
    try:
        return EngineCore(
            loaded.model,
            checkpoint.config,
            checkpoint.tokenizer,
            engine_config,
            loaded.dtype,
            loaded.device,
            loaded.draft,
        )
    except InvalidRequestError as exc:
        if memory_budget is None:
            raise
        raise ConfigError(
            f"{model}: a memory budget of {_mib(memory_budget)} leaves "
            f"{_mib(memory_budget - loaded.weight_bytes)} for the KV cache after "
            f"{_mib(loaded.weight_bytes)} of weights; "
            + str(exc).replace("raise kv_cache_memory", "raise the memory budget")
        ) from None


def _draft_checkpoint(checkpoint: Checkpoint, engine_config: EngineConfig) -> Checkpoint | None:
    """The configured draft model's checkpoint (metadata only), its vocabulary checked against the
    model's; None when no draft model drafts."""
    name = engine_config.draft_model
    if name is None or not checkpoint.config.is_decoder:
        return None
    if not engine_config.speculative:
        raise ConfigError(
            f"draft_model {name} is set but speculative decoding is off: set "
            "engine.speculative = true (--speculative) to draft with it, or unset draft_model"
        )
    draft = open_checkpoint(name)
    if not draft.config.is_decoder:
        raise ConfigError(f"draft_model {name} is an embedding model; it cannot draft tokens")
    check_same_vocabulary(
        str(checkpoint.path),
        checkpoint.tokenizer,
        checkpoint.config,
        name,
        draft.tokenizer,
        draft.config,
    )
    return draft


def _draft(
    checkpoint: Checkpoint, engine_config: EngineConfig, dtype: torch.dtype, device: torch.device
) -> DraftModel:
    """The draft model, loaded like the model."""
    module = build_model(
        checkpoint, dtype, device, attention_backend=engine_config.attention_backend
    )
    assert engine_config.draft_model is not None  # what _draft_checkpoint opened
    return DraftModel(engine_config.draft_model, module, checkpoint.config)


def _kv_left(memory_budget: int, weight_bytes: int, model: str | Path) -> int:
    left = memory_budget - weight_bytes
    if left < 2**20:
        raise ConfigError(
            f"{model}: its weights take {_mib(weight_bytes)}, leaving no room for a KV "
            f"cache in its memory budget of {_mib(memory_budget)}"
        )
    return left


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:,.1f} MiB"
