"""The Llama-family architectures of GGUF files: metadata -> ModelConfig, llama.cpp's tensor names ->
rebar's, and the tensors stored fused.

What llama.cpp's converter does per family, undone here: `llama` files have their Q/K rows
interleaved for llama.cpp's pairwise RoPE (the other families use the half-split layout rebar uses);
Gemma 3's norm weights are stored already plus one (so they load as they are) and its local layers'
RoPE base and every-sixth-layer-global pattern are llama.cpp's defaults unless the metadata says
otherwise; Phi-3 keeps q/k/v in one tensor and gate/up in `ffn_up`, split here by rows.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from rebar.errors import ModelFormatError, UnsupportedModelError
from rebar.model.config import ModelConfig, RopeScaling


@dataclass(frozen=True)
class Family:
    permuted_qk: bool  # llama.cpp interleaved each head's Q/K rows (its `llama` RoPE layout)
    qk_norm: bool = False
    sandwich_norms: bool = False
    activation: str = "silu"


FAMILIES = {
    "llama": Family(permuted_qk=True),
    "qwen2": Family(permuted_qk=False),
    "qwen3": Family(permuted_qk=False, qk_norm=True),
    "gemma3": Family(permuted_qk=False, qk_norm=True, sandwich_norms=True, activation="gelu_tanh"),
    "phi3": Family(permuted_qk=False),
}

# The turn format of Google's Gemma 3 instruction-tuned models, for Gemma 3 files that carry no
# template (the pretrained ones): a system message opens the first user turn, the assistant is
# "model". Written for rebar's sandboxed renderer (trim_blocks, lstrip_blocks).
GEMMA3_TURNS = """{{ bos_token }}{% set system = messages[0]['content'] + '\n\n' if messages[0]['role'] == 'system' else '' %}
{% for message in messages if message['role'] != 'system' %}
<start_of_turn>{{ 'model' if message['role'] == 'assistant' else message['role'] }}
{{ (system if loop.first else '') + message['content'] | trim }}<end_of_turn>
{% endfor %}
{% if add_generation_prompt %}
<start_of_turn>model
{% endif %}
"""
DEFAULT_TEMPLATES = {"gemma3": GEMMA3_TURNS}

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
    "attn_q_norm.weight": "attn.q_norm.weight",
    "attn_k_norm.weight": "attn.k_norm.weight",
    "post_attention_norm.weight": "attn_out_norm.weight",
    "post_ffw_norm.weight": "mlp_out_norm.weight",
}
_LAYER_PATTERN = re.compile(r"blk\.(\d+)\.(.+)")


@dataclass(frozen=True)
class Part:
    """A rebar tensor's source: GGUF tensor `file_name`, rows [start, end) of it when fused (None: all)."""

    file_name: str
    rows: tuple[int, int] | None = None


def tensor_parts(file_name: str, arch: str, config: ModelConfig) -> dict[str, Part] | None:
    """The rebar tensors GGUF tensor `file_name` holds, or None if rebar has no use for it."""
    if file_name in _GLOBAL_NAMES:
        return {_GLOBAL_NAMES[file_name]: Part(file_name)}
    match = _LAYER_PATTERN.fullmatch(file_name)
    if match is None:
        return None
    prefix, rest = f"layers.{match.group(1)}.", match.group(2)
    if arch == "phi3" and rest in ("attn_qkv.weight", "ffn_up.weight"):
        return {prefix + name: Part(file_name, rows) for name, rows in _phi3_rows(rest, config).items()}
    name = _LAYER_NAMES.get(rest)
    return None if name is None else {prefix + name: Part(file_name)}


def _phi3_rows(fused: str, config: ModelConfig) -> dict[str, tuple[int, int]]:
    if fused == "ffn_up.weight":  # [gate; up], as llama.cpp's fused SwiGLU splits it
        inner = config.intermediate_size
        return {"mlp.gate_proj.weight": (0, inner), "mlp.up_proj.weight": (inner, 2 * inner)}
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    return {"attn.q_proj.weight": (0, q), "attn.k_proj.weight": (q, q + kv), "attn.v_proj.weight": (q + kv, q + 2 * kv)}


def require_key(meta: dict[str, Any], key: str) -> Any:
    if key not in meta:
        raise ModelFormatError(f"GGUF metadata is missing required key {key!r}")
    return meta[key]


def _int(meta: dict[str, Any], key: str, default: Any = None) -> int:
    """An integer metadata value, or a ModelFormatError naming the key (never a bare ValueError)."""
    value = require_key(meta, key) if default is None else meta.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
        raise ModelFormatError(f"GGUF metadata {key!r} must be an integer, got {value!r}")
    return int(value)


def _float(meta: dict[str, Any], key: str, default: float | None = None) -> float:
    value = require_key(meta, key) if default is None else meta.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ModelFormatError(f"GGUF metadata {key!r} must be a finite number, got {value!r}")
    return float(value)


def _rope_scaling(meta: dict[str, Any], arch: str) -> RopeScaling | None:
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    factor = _float(meta, f"{arch}.rope.scaling.factor", 1.0)
    if kind in ("none", "") or factor == 1.0:
        return None  # llama3-style scaling is stored as a `rope_freqs` tensor instead
    if kind != "linear":
        raise UnsupportedModelError(f"GGUF rope scaling type {kind!r} is not supported")
    return RopeScaling(kind="linear", factor=factor)


def _gemma3(meta: dict[str, Any], num_layers: int, hidden: int, num_heads: int, head_dim: int) -> dict[str, Any]:
    """Gemma 3's specifics, with llama.cpp's defaults where the metadata is silent."""
    if meta.get("gemma3.final_logit_softcapping"):
        raise UnsupportedModelError("Gemma 3 with final_logit_softcapping is not supported")
    window = meta.get("gemma3.attention.sliding_window")
    specifics: dict[str, Any] = {
        "embedding_scale": math.sqrt(hidden),
        # llama.cpp (after gemma_pytorch): 1/sqrt(head_dim), but 1/sqrt(hidden / heads) for the 27B model
        "attention_scale": (hidden / num_heads if num_layers == 62 else head_dim) ** -0.5,
    }
    if window:
        pattern = meta.get("gemma3.attention.sliding_window_pattern", 6)
        if isinstance(pattern, list):  # one flag per layer
            sliding = tuple(bool(p) for p in pattern)
        else:  # a period: its last layer is global
            period = _int(meta, "gemma3.attention.sliding_window_pattern", 6)
            sliding = tuple(period == 0 or i % period < period - 1 for i in range(num_layers))
        specifics.update(sliding_window=_int(meta, "gemma3.attention.sliding_window"), sliding_layers=sliding,
                         rope_local_theta=_float(meta, "gemma3.rope.freq_base_swa", 10000.0))
    return specifics


def config_from_metadata(meta: dict[str, Any], tensor_names: set[str]) -> ModelConfig:
    arch = require_key(meta, "general.architecture")
    if arch not in FAMILIES:
        raise UnsupportedModelError(f"GGUF architecture {arch!r} is not supported; rebar runs {sorted(FAMILIES)}")
    family = FAMILIES[arch]
    hidden = _int(meta, f"{arch}.embedding_length")
    num_heads = _int(meta, f"{arch}.attention.head_count")
    num_layers = _int(meta, f"{arch}.block_count")
    if num_heads <= 0 or hidden <= 0 or num_layers <= 0:
        raise ModelFormatError(f"GGUF metadata gives {num_heads} heads, {hidden} hidden and {num_layers} layers; "
                               "each must be positive")
    head_dim = _int(meta, f"{arch}.attention.key_length", hidden // num_heads)
    rope_dim = _int(meta, f"{arch}.rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        raise UnsupportedModelError(f"partial rotary embeddings ({rope_dim} of {head_dim} dims) are not supported")
    if arch == "phi3" and ("rope_factors_long.weight" in tensor_names or meta.get("phi3.rope.scaling.attn_factor")):
        raise UnsupportedModelError("Phi-3 with LongRoPE (the 128k-context variants) is not supported; "
                                    "the 4k-context ones run")
    tokens = require_key(meta, "tokenizer.ggml.tokens")
    specifics = _gemma3(meta, num_layers, hidden, num_heads, head_dim) if arch == "gemma3" else {}
    if arch in ("llama", "qwen2", "qwen3") and meta.get(f"{arch}.attention.sliding_window"):
        specifics["sliding_window"] = _int(meta, f"{arch}.attention.sliding_window")
    try:
        return ModelConfig(
            architecture="llama",
            source_architecture=f"gguf:{arch}",
            name=str(meta.get("general.name", "")),
            vocab_size=_int(meta, f"{arch}.vocab_size", len(tokens)),
            hidden_size=hidden,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=_int(meta, f"{arch}.attention.head_count_kv", num_heads),
            head_dim=head_dim,
            intermediate_size=_int(meta, f"{arch}.feed_forward_length"),
            max_position_embeddings=_int(meta, f"{arch}.context_length"),
            norm_eps=_float(meta, f"{arch}.attention.layer_norm_rms_epsilon"),
            rope_theta=_float(meta, f"{arch}.rope.freq_base", 10000.0),
            rope_scaling=_rope_scaling(meta, arch),
            qkv_bias="blk.0.attn_q.bias" in tensor_names,
            o_bias="blk.0.attn_output.bias" in tensor_names,
            tie_word_embeddings="output.weight" not in tensor_names,
            qk_norm=family.qk_norm,
            sandwich_norms=family.sandwich_norms,
            activation=family.activation,
            **specifics,
        )
    except ValueError as exc:  # ModelConfig's own checks (head counts, head_dim, ...)
        raise ModelFormatError(f"GGUF metadata describes an impossible model: {exc}") from exc
