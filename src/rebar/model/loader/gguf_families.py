"""The Llama-family architectures of GGUF files: metadata -> ModelConfig, llama.cpp's tensor names
-> rebar's, and the tensors stored fused.

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

from rebar.errors import UnsupportedModelError
from rebar.model.config import DIMENSION_LIMITS, ModelConfig, RopeScaling
from rebar.model.loader.config_values import ConfigValues


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
GEMMA3_TURNS = """{{ bos_token }}{% set system = messages[0]['content'] + '\n\n' \
if messages[0]['role'] == 'system' else '' %}
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
    """A rebar tensor's source: GGUF tensor `file_name`, rows [start, end) of it when fused (None:
    all)."""

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
        return {
            prefix + name: Part(file_name, rows) for name, rows in _phi3_rows(rest, config).items()
        }
    name = _LAYER_NAMES.get(rest)
    return None if name is None else {prefix + name: Part(file_name)}


def _phi3_rows(fused: str, config: ModelConfig) -> dict[str, tuple[int, int]]:
    if fused == "ffn_up.weight":  # [gate; up], as llama.cpp's fused SwiGLU splits it
        inner = config.intermediate_size
        return {"mlp.gate_proj.weight": (0, inner), "mlp.up_proj.weight": (inner, 2 * inner)}
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    return {
        "attn.q_proj.weight": (0, q),
        "attn.k_proj.weight": (q, q + kv),
        "attn.v_proj.weight": (q + kv, q + 2 * kv),
    }


def _rope_scaling(values: ConfigValues, arch: str) -> RopeScaling | None:
    kind = values.string(f"{arch}.rope.scaling.type", "none")
    factor = values.number(f"{arch}.rope.scaling.factor", 1.0)
    if kind in ("none", "") or factor == 1.0:
        return None  # llama3-style scaling is stored as a `rope_freqs` tensor instead
    if kind != "linear":
        raise UnsupportedModelError(f"GGUF rope scaling type {kind!r} is not supported")
    return RopeScaling(kind="linear", factor=factor)


def _gemma3(
    values: ConfigValues, num_layers: int, hidden: int, num_heads: int, head_dim: int
) -> dict[str, Any]:
    """Gemma 3's specifics, with llama.cpp's defaults where the metadata is silent."""
    if values.raw("gemma3.final_logit_softcapping", None):
        raise UnsupportedModelError("Gemma 3 with final_logit_softcapping is not supported")
    specifics: dict[str, Any] = {
        "embedding_scale": math.sqrt(hidden),
        # llama.cpp (after gemma_pytorch): 1/sqrt(head_dim), but 1/sqrt(hidden / heads) for the 27B
        # model
        "attention_scale": (hidden / num_heads if num_layers == 62 else head_dim) ** -0.5,
    }
    window_key, pattern_key = (
        "gemma3.attention.sliding_window",
        "gemma3.attention.sliding_window_pattern",
    )
    if values.integer(window_key, 0, high=DIMENSION_LIMITS["sliding_window"]):
        if isinstance(values.raw(pattern_key, None), list):  # one flag per layer
            sliding = tuple(bool(p) for p in values.list_of(pattern_key, "flags"))
        else:  # a period: its last layer is global
            period = values.integer(pattern_key, 6, high=DIMENSION_LIMITS["num_layers"])
            sliding = tuple(period == 0 or i % period < period - 1 for i in range(num_layers))
        values.keys["sliding_layers"] = pattern_key
        specifics.update(
            sliding_window=values.dimension(window_key, "sliding_window"),
            sliding_layers=sliding,
            rope_local_theta=values.number("gemma3.rope.freq_base_swa", 10000.0),
        )
    return specifics


def _refuse_variants(
    values: ConfigValues, arch: str, head_dim: int, tensor_names: set[str]
) -> None:
    """Refuse by name the variants of a family rebar would otherwise run wrongly."""
    rope_dim = values.integer(
        f"{arch}.rope.dimension_count", head_dim, low=1, high=DIMENSION_LIMITS["head_dim"]
    )
    if rope_dim != head_dim:
        raise UnsupportedModelError(
            f"partial rotary embeddings ({rope_dim} of {head_dim} dims) are not supported"
        )
    long_rope = "rope_factors_long.weight" in tensor_names or values.raw(
        "phi3.rope.scaling.attn_factor", None
    )
    if arch == "phi3" and long_rope:
        raise UnsupportedModelError(
            "Phi-3 with LongRoPE (the 128k-context variants) is not supported; "
            "the 4k-context ones run"
        )


def config_from_metadata(meta: dict[str, Any], tensor_names: set[str]) -> ModelConfig:
    values = ConfigValues(meta, "GGUF metadata")
    arch = values.string("general.architecture")
    if arch not in FAMILIES:
        raise UnsupportedModelError(
            f"GGUF architecture {arch!r} is not supported; rebar runs {sorted(FAMILIES)}"
        )
    family = FAMILIES[arch]
    hidden = values.dimension(f"{arch}.embedding_length", "hidden_size")
    num_heads = values.dimension(f"{arch}.attention.head_count", "num_heads")
    num_layers = values.dimension(f"{arch}.block_count", "num_layers")
    head_dim = values.head_dim(f"{arch}.attention.key_length", hidden, num_heads)
    _refuse_variants(values, arch, head_dim, tensor_names)
    tokens = values.list_of("tokenizer.ggml.tokens", "strings")
    specifics = _gemma3(values, num_layers, hidden, num_heads, head_dim) if arch == "gemma3" else {}
    window_key = f"{arch}.attention.sliding_window"
    if arch in ("llama", "qwen2", "qwen3") and values.raw(window_key, None):
        specifics["sliding_window"] = values.dimension(window_key, "sliding_window")
    return values.model_config(
        architecture="llama",
        source_architecture=f"gguf:{arch}",
        name=str(meta.get("general.name", "")),
        vocab_size=values.dimension(f"{arch}.vocab_size", "vocab_size", len(tokens)),
        hidden_size=hidden,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=values.dimension(f"{arch}.attention.head_count_kv", "num_kv_heads", num_heads),
        head_dim=head_dim,
        intermediate_size=values.dimension(f"{arch}.feed_forward_length", "intermediate_size"),
        max_position_embeddings=values.dimension(
            f"{arch}.context_length", "max_position_embeddings"
        ),
        norm_eps=values.number(f"{arch}.attention.layer_norm_rms_epsilon"),
        rope_theta=values.number(f"{arch}.rope.freq_base", 10000.0),
        rope_scaling=_rope_scaling(values, arch),
        qkv_bias="blk.0.attn_q.bias" in tensor_names,
        o_bias="blk.0.attn_output.bias" in tensor_names,
        tie_word_embeddings="output.weight" not in tensor_names,
        qk_norm=family.qk_norm,
        sandwich_norms=family.sandwich_norms,
        activation=family.activation,
        **specifics,
    )
