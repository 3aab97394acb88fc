"""GGUF v3 loader for Llama-family checkpoints (the `llama` and `qwen2` GGUF architectures).

Metadata becomes a `ModelConfig` and a `Tokenizer`. Quantized 2-D tensors are handed over as
`BlockWeight`s, views of the memory-mapped file that rebar's kernels repack; everything else (and
everything, with `--dequantize`) is dequantized one tensor at a time into its final dtype. llama.cpp
stores the Q and K projections of `llama` models with rows interleaved for its pairwise RoPE; rebar
undoes that permutation here so the model uses the same half-split RoPE layout for GGUF and HF
weights.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rebar.errors import ModelFormatError, UnsupportedModelError
from rebar.model.config import ModelConfig, RopeScaling
from rebar.model.loader.base import Checkpoint, TensorInfo
from rebar.model.loader.ggml_dequant import BLOCK_TYPES, SUPPORTED_TYPES, dequantize
from rebar.model.loader.gguf_reader import GGUFFile, GGUFTensor
from rebar.model.tokenizer import Tokenizer
from rebar.quant.block_weight import BlockWeight

# GGUF architectures rebar runs, and whether llama.cpp permuted their Q/K rows.
_ARCHITECTURES = {"llama": True, "qwen2": False}

_GLOBAL_NAMES = {
    "token_embd.weight": "embed_tokens.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "lm_head.weight",
    "rope_freqs.weight": "rope_freq_factors",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_norm.weight",
    "ffn_norm.weight": "post_attn_norm.weight",
    "attn_q.weight": "attn.q_proj.weight",
    "attn_q.bias": "attn.q_proj.bias",
    "attn_k.weight": "attn.k_proj.weight",
    "attn_k.bias": "attn.k_proj.bias",
    "attn_v.weight": "attn.v_proj.weight",
    "attn_v.bias": "attn.v_proj.bias",
    "attn_output.weight": "attn.o_proj.weight",
    "attn_output.bias": "attn.o_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_LAYER_PATTERN = re.compile(r"blk\.(\d+)\.(.+)")


def rebar_name(file_name: str) -> str | None:
    """rebar's tensor name for a GGUF tensor name, or None if rebar has no use for it."""
    if file_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[file_name]
    match = _LAYER_PATTERN.fullmatch(file_name)
    if match and match.group(2) in _LAYER_NAMES:
        return f"layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"
    return None


def _require(meta: dict[str, Any], key: str) -> Any:
    if key not in meta:
        raise ModelFormatError(f"GGUF metadata is missing required key {key!r}")
    return meta[key]


def config_from_metadata(meta: dict[str, Any], tensor_names: set[str]) -> ModelConfig:
    arch = _require(meta, "general.architecture")
    if arch not in _ARCHITECTURES:
        raise UnsupportedModelError(
            f"GGUF architecture {arch!r} is not supported; rebar runs {sorted(_ARCHITECTURES)}"
        )
    hidden = int(_require(meta, f"{arch}.embedding_length"))
    num_heads = int(_require(meta, f"{arch}.attention.head_count"))
    head_dim = int(meta.get(f"{arch}.attention.key_length", hidden // num_heads))
    rope_dim = int(meta.get(f"{arch}.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise UnsupportedModelError(f"partial rotary embeddings ({rope_dim} of {head_dim} dims) are not supported")
    tokens = _require(meta, "tokenizer.ggml.tokens")
    return ModelConfig(
        architecture="llama",
        source_architecture=f"gguf:{arch}",
        name=str(meta.get("general.name", "")),
        vocab_size=int(meta.get(f"{arch}.vocab_size", len(tokens))),
        hidden_size=hidden,
        num_layers=int(_require(meta, f"{arch}.block_count")),
        num_heads=num_heads,
        num_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        intermediate_size=int(_require(meta, f"{arch}.feed_forward_length")),
        max_position_embeddings=int(_require(meta, f"{arch}.context_length")),
        norm_eps=float(_require(meta, f"{arch}.attention.layer_norm_rms_epsilon")),
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(meta, arch),
        qkv_bias="blk.0.attn_q.bias" in tensor_names,
        o_bias="blk.0.attn_output.bias" in tensor_names,
        tie_word_embeddings="output.weight" not in tensor_names,
        sliding_window=meta.get(f"{arch}.attention.sliding_window"),
    )


def _rope_scaling(meta: dict[str, Any], arch: str) -> RopeScaling | None:
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    factor = float(meta.get(f"{arch}.rope.scaling.factor", 1.0))
    if kind in ("none", "") or factor == 1.0:
        return None  # llama3-style scaling is stored as a `rope_freqs` tensor instead
    if kind != "linear":
        raise UnsupportedModelError(f"GGUF rope scaling type {kind!r} is not supported")
    return RopeScaling(kind="linear", factor=factor)


def tokenizer_from_metadata(meta: dict[str, Any]) -> Tokenizer:
    bos = meta.get("tokenizer.ggml.bos_token_id")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    return Tokenizer.from_gguf_vocab(
        model=str(_require(meta, "tokenizer.ggml.model")),
        pre=str(meta.get("tokenizer.ggml.pre", "default")),
        tokens=_require(meta, "tokenizer.ggml.tokens"),
        token_types=meta.get("tokenizer.ggml.token_type"),
        merges=meta.get("tokenizer.ggml.merges", []),
        bos_token_id=None if bos is None else int(bos),
        eos_token_id=None if eos is None else int(eos),
        add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
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
    permuted = _ARCHITECTURES[meta["general.architecture"]]

    infos: dict[str, TensorInfo] = {}
    for file_name, tensor in gguf.tensors.items():
        name = rebar_name(file_name)
        if name is None:
            raise UnsupportedModelError(f"GGUF tensor {file_name!r} has no place in a {config.source_architecture} model")
        _check_storage(file_name, tensor)
        infos[name] = TensorInfo(name, file_name, tensor.shape, tensor.qtype.name, tensor.num_bytes)

    def load(name: str, dtype: torch.dtype) -> torch.Tensor:
        tensor = gguf.tensors[infos[name].file_name]
        values = dequantize(tensor.data(gguf.buffer), tensor.qtype, dtype).reshape(tensor.shape)
        heads = _row_heads(name, config) if permuted else None
        return values if heads is None else _unpermute_rows(values, heads)

    def load_quantized(name: str) -> BlockWeight | None:
        tensor = gguf.tensors[infos[name].file_name]
        if tensor.qtype not in BLOCK_TYPES or len(tensor.shape) != 2:
            return None
        weight = BlockWeight(tensor.qtype.name, gguf.raw_rows(tensor), tensor.shape[1])
        heads = _row_heads(name, config) if permuted else None
        if heads is None:
            return weight
        return weight.select_rows(_unpermute_rows(torch.arange(tensor.shape[0]), heads))

    def release(name: str) -> None:
        gguf.release(gguf.tensors[infos[name].file_name])

    template = meta.get("tokenizer.chat_template")
    return Checkpoint(
        path=path,
        format="gguf",
        config=config,
        tokenizer=tokenizer_from_metadata(meta),
        chat_template=str(template) if template else None,
        tensors=infos,
        _load=load,
        _load_quantized=load_quantized,
        _release=release,
        metadata={k: _summary(v) for k, v in meta.items() if not k.startswith("tokenizer.ggml.")},
    )


_SUPPORTED_NAMES = ", ".join(sorted(qtype.name for qtype in SUPPORTED_TYPES))


def _check_storage(file_name: str, tensor: GGUFTensor) -> None:
    """A clear error for a tensor type rebar does not run, or one that does not suit the tensor."""
    if tensor.qtype not in SUPPORTED_TYPES:
        raise UnsupportedModelError(
            f"GGUF tensor {file_name!r} uses type {tensor.qtype.name}, which rebar does not run (it runs "
            f"{_SUPPORTED_NAMES}); re-quantize the original weights to one of them with llama.cpp, e.g. "
            f"`llama-quantize model-f16.gguf model-Q4_K_M.gguf Q4_K_M`"
        )
    if tensor.qtype in BLOCK_TYPES and len(tensor.shape) != 2:
        raise ModelFormatError(
            f"GGUF tensor {file_name!r} has shape {list(tensor.shape)} but is stored as {tensor.qtype.name}: "
            f"block-quantized types hold 2-D weights only (norms and biases are F32)"
        )


def _summary(value: Any) -> str:
    if isinstance(value, (list, np.ndarray)) and len(value) > 8:
        return f"[{len(value)} values]"
    return str(value)


