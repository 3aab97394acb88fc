"""The Llama-family decoders of Hugging Face folders: their config.json -> ModelConfig, their tensor
names -> rebar's, and the tensors that need reshaping on the way in.

Llama, Mistral, Qwen2 and Qwen3 map one file tensor to one rebar tensor. Gemma 3 stores every
RMSNorm weight as w - 1 (its norm multiplies by 1 + w), so they are read plus one. Phi-3 fuses q/k/v
into one projection and gate/up into another; their rows are read as the separate tensors the model
has.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from rebar.errors import ModelFormatError, UnsupportedModelError
from rebar.model.config import DIMENSION_LIMITS, InvalidModelConfig, ModelConfig, RopeScaling
from rebar.model.loader.config_values import ConfigValues

DECODER_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Gemma3ForCausalLM",
    "Phi3ForCausalLM",
)

_PROJECTIONS = {
    f"self_attn.{p}.{k}": f"attn.{p}.{k}"
    for p in ("q_proj", "k_proj", "v_proj", "o_proj")
    for k in ("weight", "bias")
}
_MLP = {
    f"mlp.{p}.{k}": f"mlp.{p}.{k}"
    for p in ("gate_proj", "up_proj", "down_proj")
    for k in ("weight", "bias")
}
_QK_NORMS = {
    "self_attn.q_norm.weight": "attn.q_norm.weight",
    "self_attn.k_norm.weight": "attn.k_norm.weight",
}
_LLAMA_NORMS = {
    "input_layernorm.weight": "input_norm.weight",
    "post_attention_layernorm.weight": "post_attn_norm.weight",
}
# Gemma 3's four norms: its "post_attention_layernorm" norms the attention's output, and
# "pre_feedforward_layernorm" is the MLP's input norm (Llama's post_attention_layernorm).
_GEMMA3_NORMS = {
    "input_layernorm.weight": "input_norm.weight",
    "post_attention_layernorm.weight": "attn_out_norm.weight",
    "pre_feedforward_layernorm.weight": "post_attn_norm.weight",
    "post_feedforward_layernorm.weight": "mlp_out_norm.weight",
}
_LAYER_NAMES = {
    "LlamaForCausalLM": {**_LLAMA_NORMS, **_PROJECTIONS, **_MLP},
    "MistralForCausalLM": {**_LLAMA_NORMS, **_PROJECTIONS, **_MLP},
    "Qwen2ForCausalLM": {**_LLAMA_NORMS, **_PROJECTIONS, **_MLP},
    "Qwen3ForCausalLM": {**_LLAMA_NORMS, **_PROJECTIONS, **_MLP, **_QK_NORMS},
    "Gemma3ForCausalLM": {**_GEMMA3_NORMS, **_PROJECTIONS, **_MLP, **_QK_NORMS},
    # The fused projections are split by `fused_parts`.
    "Phi3ForCausalLM": {
        **_LLAMA_NORMS,
        "self_attn.o_proj.weight": "attn.o_proj.weight",
        "mlp.down_proj.weight": "mlp.down_proj.weight",
    },
}
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")


@dataclass(frozen=True)
class Part:
    """Where a rebar tensor's values come from: `file_name`'s rows [start, end) (all: None), plus
    one when `add_one` (Gemma's norm weights)."""

    file_name: str
    rows: tuple[int, int] | None = None
    add_one: bool = False


def tensor_parts(file_name: str, arch: str, config: ModelConfig) -> dict[str, Part] | None:
    """The rebar tensors file tensor `file_name` holds (one, or the parts of a fused one), or None
    when the architecture has no place for it."""
    add_one = arch == "Gemma3ForCausalLM" and file_name.endswith("norm.weight")
    if file_name == "model.embed_tokens.weight":
        return {"embed_tokens.weight": Part(file_name)}
    if file_name == "model.norm.weight":
        return {"norm.weight": Part(file_name, add_one=add_one)}
    if file_name == "lm_head.weight":
        return {"lm_head.weight": Part(file_name)}
    match = _LAYER.fullmatch(file_name)
    if match is None:
        return None
    prefix, rest = f"layers.{match.group(1)}.", match.group(2)
    if arch == "Phi3ForCausalLM" and rest in _PHI3_FUSED:
        return {
            prefix + name: Part(file_name, rows) for name, rows in _phi3_rows(rest, config).items()
        }
    name = _LAYER_NAMES[arch].get(rest)
    return None if name is None else {prefix + name: Part(file_name, add_one=add_one)}


_PHI3_FUSED = ("self_attn.qkv_proj.weight", "mlp.gate_up_proj.weight")


def _phi3_rows(fused: str, config: ModelConfig) -> dict[str, tuple[int, int]]:
    if fused == "mlp.gate_up_proj.weight":
        inner = config.intermediate_size
        return {"mlp.gate_proj.weight": (0, inner), "mlp.up_proj.weight": (inner, 2 * inner)}
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    return {
        "attn.q_proj.weight": (0, q),
        "attn.k_proj.weight": (q, q + kv),
        "attn.v_proj.weight": (q + kv, q + 2 * kv),
    }


def _rope(params: ConfigValues, theta: float) -> tuple[float, RopeScaling | None]:
    kind = params.string("rope_type", None) or params.string("type", "default")
    theta = params.number("rope_theta", theta)
    if kind == "default":
        return theta, None
    if kind == "linear":
        return theta, RopeScaling(kind="linear", factor=params.number("factor"))
    if kind == "llama3":
        scaling = {
            "factor": params.number("factor"),
            "low_freq_factor": params.number("low_freq_factor"),
            "high_freq_factor": params.number("high_freq_factor"),
        }
        original = params.dimension("original_max_position_embeddings", "original_max_position")
        try:
            return theta, RopeScaling(kind="llama3", original_max_position=original, **scaling)
        except InvalidModelConfig as exc:
            raise ModelFormatError(f"{params.source}: {exc}") from exc
    raise UnsupportedModelError(
        f"rope scaling type {kind!r} is not supported (rebar has linear and llama3)"
    )


def _rope_config(config: ConfigValues) -> tuple[float, RopeScaling | None, float | None]:
    """(global theta, global scaling, local theta or None). transformers 4.x writes rope_theta +
    rope_scaling, 5.x one rope_parameters dict, per layer type for Gemma 3."""
    params = config.section(
        "rope_parameters" if config.raw("rope_parameters", None) else "rope_scaling"
    )
    base = config.number("rope_theta", 10000.0)
    if params.has("full_attention"):  # one set per layer type
        theta, scaling = _rope(params.section("full_attention"), base)
        if not params.has("sliding_attention"):
            return theta, scaling, None
        local_base = config.number("rope_local_base_freq", 10000.0)
        local_theta, local_scaling = _rope(params.section("sliding_attention"), local_base)
        if local_scaling is not None:
            raise UnsupportedModelError("scaled RoPE on the sliding-window layers is not supported")
        return theta, scaling, local_theta
    theta, scaling = _rope(params, base)
    if config.has("rope_local_base_freq"):  # 4.x Gemma 3
        return theta, scaling, config.number("rope_local_base_freq")
    return theta, scaling, None


def _layer_types(config: ConfigValues, arch: str, num_layers: int) -> list[str] | None:
    """Each layer's attention ("sliding_attention" or "full_attention"), or None when every layer
    slides."""
    if config.has("layer_types"):
        config.keys["sliding_layers"] = "layer_types"
        return config.list_of("layer_types", "strings")
    if arch in (
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
    ):  # transformers 4.x: layers from max_window_layers on
        first = config.integer("max_window_layers", 0, high=DIMENSION_LIMITS["num_layers"])
        return ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    if arch == "Gemma3ForCausalLM":  # transformers 4.x: every sixth layer is global
        pattern = config.integer(
            "sliding_window_pattern", 6, low=1, high=DIMENSION_LIMITS["num_layers"]
        )
        return [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
            for i in range(num_layers)
        ]
    return None


def _sliding(
    config: ConfigValues, arch: str, num_layers: int
) -> tuple[int | None, tuple[bool, ...] | None]:
    """(window, which layers use it; None: all of them)."""
    is_qwen = arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM")
    if not config.raw("sliding_window", 0) or (
        is_qwen and not config.flag("use_sliding_window", False)
    ):
        return None, None
    window = config.dimension("sliding_window", "sliding_window")
    layer_types = _layer_types(config, arch, num_layers)
    if layer_types is None:
        return window, None
    sliding = tuple(kind == "sliding_attention" for kind in layer_types)
    if not any(sliding):
        return None, None
    return window, None if all(sliding) else sliding


_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


def _check_supported(config: ConfigValues, arch: str) -> None:
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if config.raw(key, None):
            raise UnsupportedModelError(f"{arch} with {key}={config.raw(key)} is not supported")
    factor = config.number("partial_rotary_factor", 1.0)
    if factor != 1.0:
        raise UnsupportedModelError(f"partial rotary embeddings ({factor}) are not supported")


def decoder_config(config: ConfigValues, arch: str) -> ModelConfig:
    _check_supported(config, arch)
    act = config.string("hidden_activation", None) or config.string("hidden_act", "silu")
    if act not in _ACTIVATIONS:
        raise UnsupportedModelError(
            f"activation {act!r} is not supported for {arch} (rebar has {sorted(_ACTIVATIONS)})"
        )
    hidden = config.dimension("hidden_size", "hidden_size")
    num_heads = config.dimension("num_attention_heads", "num_heads")
    num_layers = config.dimension("num_hidden_layers", "num_layers")
    head_dim = config.head_dim("head_dim", hidden, num_heads)
    theta, scaling, local_theta = _rope_config(config)
    window, sliding_layers = _sliding(config, arch, num_layers)
    attention_bias = config.flag("attention_bias", False)
    is_gemma = arch == "Gemma3ForCausalLM"
    scalar = (
        config.number("query_pre_attn_scalar")
        if config.raw("query_pre_attn_scalar", None)
        else None
    )
    return config.model_config(
        architecture="llama",
        source_architecture=arch,
        name=str(config.raw("_name_or_path", "")),
        vocab_size=config.dimension("vocab_size", "vocab_size"),
        hidden_size=hidden,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=config.dimension("num_key_value_heads", "num_kv_heads", num_heads),
        head_dim=head_dim,
        intermediate_size=config.dimension("intermediate_size", "intermediate_size"),
        max_position_embeddings=config.dimension(
            "max_position_embeddings", "max_position_embeddings", 2048
        ),
        norm_eps=config.number("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        qkv_bias=arch == "Qwen2ForCausalLM" or attention_bias,
        o_bias=attention_bias,
        mlp_bias=config.flag("mlp_bias", False),
        tie_word_embeddings=config.flag("tie_word_embeddings", is_gemma),
        sliding_window=window,
        sliding_layers=sliding_layers,
        rope_local_theta=local_theta if window is not None else None,
        qk_norm=arch in ("Qwen3ForCausalLM", "Gemma3ForCausalLM"),
        sandwich_norms=is_gemma,
        activation=_ACTIVATIONS[act],
        embedding_scale=math.sqrt(hidden) if is_gemma else 1.0,
        attention_scale=scalar**-0.5 if scalar else None,
    )
