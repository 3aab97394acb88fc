"""What every loader returns: a config, a tokenizer, and tensors under rebar's own names."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from rebar.model.config import ModelConfig
from rebar.model.tokenizer import Tokenizer

if TYPE_CHECKING:
    from rebar.weights.block_weight import BlockWeight
    from rebar.weights.int_formats import QuantizedWeight


@dataclass(frozen=True)
class TensorInfo:
    """One stored tensor as the file holds it (for `rebar inspect` and error messages)."""

    name: str  # rebar's name, e.g. "layers.0.attn.q_proj.weight"
    file_name: str  # the name in the file, e.g. "blk.0.attn_q.weight"
    shape: tuple[int, ...]  # torch order, outermost first
    storage: str  # dtype or quantization type in the file, e.g. "Q4_1", "bfloat16"
    num_bytes: int


@dataclass
class Checkpoint:
    """A model on disk, opened but not yet materialised.

    `load_tensor(name, dtype)` reads (memory-mapped) and, for quantized files, dequantizes one
    tensor straight into `dtype`; loaders never build a second full copy of the weights.
    `load_quantized(name)` returns the tensor as integer codes instead, when the file stores it in
    a format rebar's quantized layers run (GGUF block types, rebar's own quantized checkpoints): a
    view of the file, not a copy. `release(name)` then lets the tensor's file pages leave resident
    memory once its weight has been repacked (a no-op for loaders that copy).
    """

    path: Path
    format: str  # "gguf" or "hf"
    config: ModelConfig
    tokenizer: Tokenizer
    chat_template: str | None
    tensors: dict[str, TensorInfo]
    _load: Callable[[str, torch.dtype], torch.Tensor] = field(repr=False)
    metadata: dict[str, str] = field(default_factory=dict)
    _load_quantized: Callable[[str], QuantizedWeight | BlockWeight | None] | None = field(
        default=None, repr=False
    )
    _release: Callable[[str], None] | None = field(default=None, repr=False)

    def load_tensor(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        return self._load(name, dtype)

    def load_quantized(self, name: str) -> QuantizedWeight | BlockWeight | None:
        return None if self._load_quantized is None else self._load_quantized(name)

    def release(self, name: str) -> None:
        if self._release is not None:
            self._release(name)
