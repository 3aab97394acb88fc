"""GGUF v3 loader for Llama-family checkpoints (`llama`, `qwen2`, `qwen3`, `gemma3`, `phi3`:
gguf_families.py).

Metadata becomes a `ModelConfig` and a `Tokenizer`. Quantized 2-D tensors are handed over as
`BlockWeight`s, views of the memory-mapped file that rebar's kernels repack; everything else (and
everything, with `--dequantize`) is dequantized one tensor at a time into its final dtype. llama.cpp
stores the Q and K projections of `llama` models with rows interleaved for its pairwise RoPE; rebar
undoes that permutation here so the model uses the same half-split RoPE layout for GGUF and HF
weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from rebar import heap
from rebar.errors import ModelFormatError, UnsupportedModelError
from rebar.model.config import ModelConfig
from rebar.model.loader.base import Checkpoint, TensorInfo
from rebar.model.loader.config_values import ConfigValues
from rebar.model.loader.ggml_dequant import BLOCK_TYPES, SUPPORTED_TYPES, dequantize
from rebar.model.loader.gguf_families import (
    DEFAULT_TEMPLATES,
    FAMILIES,
    Part,
    config_from_metadata,
    tensor_parts,
)
from rebar.model.loader.gguf_reader import GGUFFile, GGUFTensor
from rebar.model.tokenizer import Tokenizer
from rebar.weights.block_weight import BlockWeight


def tokenizer_from_metadata(meta: dict[str, Any]) -> Tokenizer:
    values = ConfigValues(meta, "GGUF metadata")
    tokens = values.list_of("tokenizer.ggml.tokens", "strings")
    token_types = values.list_of("tokenizer.ggml.token_type", "integers", None)
    if token_types is not None and len(token_types) != len(tokens):
        raise ModelFormatError(
            f"GGUF metadata 'tokenizer.ggml.token_type' has {len(token_types)} entries for "
            f"{len(tokens)} tokens"
        )

    def token_id(key: str) -> int | None:
        return values.token_id(f"tokenizer.ggml.{key}", len(tokens))

    return Tokenizer.from_gguf_vocab(
        model=values.string("tokenizer.ggml.model"),
        pre=values.string("tokenizer.ggml.pre", "default"),
        tokens=tokens,
        token_types=token_types,
        merges=values.list_of("tokenizer.ggml.merges", "strings", []),
        bos_token_id=token_id("bos_token_id"),
        eos_token_id=token_id("eos_token_id"),
        add_bos=values.flag("tokenizer.ggml.add_bos_token", False),
        scores=values.list_of("tokenizer.ggml.scores", "numbers", None),
        unknown_token_id=token_id("unknown_token_id"),
        add_space_prefix=values.flag("tokenizer.ggml.add_space_prefix", True),
        end_of_turn_ids=[
            i for i in (token_id("eot_token_id"), token_id("eom_token_id")) if i is not None
        ],
    )


def _unpermute_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    # llama.cpp interleaves each head's rows as (pair, 2); HF keeps the two halves apart.
    head_dim = weight.shape[0] // num_heads
    rest = weight.shape[1:]
    return weight.reshape(num_heads, head_dim // 2, 2, *rest).transpose(1, 2).reshape(weight.shape)


def _row_heads(name: str, config: ModelConfig) -> int | None:
    """Heads whose rows llama.cpp permuted in tensor `name`, or None when it left the rows alone."""
    if name.endswith(("q_proj.weight", "q_proj.bias")):
        return config.num_heads
    if name.endswith(("k_proj.weight", "k_proj.bias")):
        return config.num_kv_heads
    return None


def load_gguf(path: Path) -> Checkpoint:
    gguf = GGUFFile(path)
    meta = gguf.metadata
    config = config_from_metadata(meta, set(gguf.tensors))
    arch = meta["general.architecture"]
    infos, parts = _tensor_index(gguf, arch, config)
    source = _TensorSource(gguf, parts, config if FAMILIES[arch].permuted_qk else None)
    template = ConfigValues(meta, "GGUF metadata").string(
        "tokenizer.chat_template", ""
    ) or DEFAULT_TEMPLATES.get(arch)
    tokenizer = tokenizer_from_metadata(meta)
    for key in _VOCABULARY_KEYS:  # the tokenizer holds them now; as Python lists they take ~40 MiB
        meta.pop(key, None)
    heap.trim()
    return Checkpoint(
        path=path,
        format="gguf",
        config=config,
        tokenizer=tokenizer,
        chat_template=str(template) if template else None,
        tensors=infos,
        _load=source.load,
        _load_quantized=source.load_quantized,
        _release=source.release,
        metadata={k: _summary(v) for k, v in meta.items() if not k.startswith("tokenizer.ggml.")},
    )


def _tensor_index(
    gguf: GGUFFile, arch: str, config: ModelConfig
) -> tuple[dict[str, TensorInfo], dict[str, Part]]:
    """Each rebar tensor's description and where it comes from (a fused GGUF tensor gives several,
    each a range of its rows); a tensor the family has no place for, or rows the file lacks, are
    refused."""
    infos: dict[str, TensorInfo] = {}
    parts: dict[str, Part] = {}
    for file_name, tensor in gguf.tensors.items():
        held = tensor_parts(file_name, arch, config)
        if held is None:
            raise UnsupportedModelError(
                f"GGUF tensor {file_name!r} has no place in a {config.source_architecture} model"
            )
        _check_storage(file_name, tensor)
        for name, part in held.items():
            shape = tensor.shape
            if part.rows is not None:
                if part.rows[1] > shape[0]:
                    raise ModelFormatError(
                        f"GGUF tensor {file_name!r} has {shape[0]} rows; {name} needs rows "
                        f"{part.rows[0]}..{part.rows[1]} from the model's metadata"
                    )
                shape = (part.rows[1] - part.rows[0], *shape[1:])
            infos[name] = TensorInfo(name, file_name, shape, tensor.qtype.name, tensor.num_bytes)
            parts[name] = part
    return infos, parts


class _TensorSource:
    """Reads rebar tensors out of a GGUF file: dequantized, or kept in their block format.

    `permuted` is the config of a family whose converter permuted Q/K rows for llama.cpp's RoPE
    layout (their rows are put back in HF order), None for the others.
    """

    def __init__(self, gguf: GGUFFile, parts: dict[str, Part], permuted: ModelConfig | None):
        self.gguf, self.parts, self.permuted = gguf, parts, permuted

    def _heads(self, name: str) -> int | None:
        return _row_heads(name, self.permuted) if self.permuted is not None else None

    def load(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        part = self.parts[name]
        tensor = self.gguf.tensors[part.file_name]
        raw = tensor.data(self.gguf.buffer)
        values = dequantize(raw, tensor.qtype, dtype).reshape(tensor.shape)
        if part.rows is not None:
            values = values[part.rows[0] : part.rows[1]].contiguous()
        heads = self._heads(name)
        return values if heads is None else _unpermute_rows(values, heads)

    def load_quantized(self, name: str) -> BlockWeight | None:
        part = self.parts[name]
        tensor = self.gguf.tensors[part.file_name]
        if tensor.qtype not in BLOCK_TYPES or len(tensor.shape) != 2:
            return None
        weight = BlockWeight(
            tensor.qtype.name,
            self.gguf.raw_rows(tensor),
            tensor.shape[1],
            release_pages=self.gguf.release_view,
        )
        if part.rows is not None:
            weight = weight.row_slice(*part.rows)
        heads = self._heads(name)
        if heads is None:
            return weight
        return weight.select_rows(_unpermute_rows(torch.arange(weight.out_features), heads))

    def release(self, name: str) -> None:
        self.gguf.release(self.gguf.tensors[self.parts[name].file_name])


_VOCABULARY_KEYS = (
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.scores",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.merges",
)
_SUPPORTED_NAMES = ", ".join(sorted(qtype.name for qtype in SUPPORTED_TYPES))


def _check_storage(file_name: str, tensor: GGUFTensor) -> None:
    """A clear error for a tensor type rebar does not run, or one that does not suit the tensor."""
    if tensor.qtype not in SUPPORTED_TYPES:
        raise UnsupportedModelError(
            f"GGUF tensor {file_name!r} uses type {tensor.qtype.name}, which rebar does not run "
            f"(it runs {_SUPPORTED_NAMES}); re-quantize the original weights to one of them with "
            "llama.cpp, e.g. `llama-quantize model-f16.gguf model-Q4_K_M.gguf Q4_K_M`"
        )
    if tensor.qtype in BLOCK_TYPES and len(tensor.shape) != 2:
        raise ModelFormatError(
            f"GGUF tensor {file_name!r} has shape {list(tensor.shape)} but is stored as "
            f"{tensor.qtype.name}: block-quantized types hold 2-D weights only "
            "(norms and biases are F32)"
        )


def _summary(value: Any) -> str:
    if isinstance(value, (list, np.ndarray)) and len(value) > 8:
        return f"[{len(value)} values]"
    return str(value)
