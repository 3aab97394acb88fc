"""A decoder's family traits in words, for `rebar inspect`: which layers slide, which RoPE base each
kind of layer uses, where the norms sit, which MLP it gates with."""

from __future__ import annotations

from rebar.model.config import ModelConfig

_MLPS = {"silu": "SwiGLU (SiLU-gated)", "gelu_tanh": "GeGLU (tanh-GELU-gated)"}


def _number(value: float) -> str:
    return f"{value:,.0f}" if float(value).is_integer() else f"{value:g}"


def layer_pattern(config: ModelConfig) -> str:
    """One letter per layer, S (sliding window) or G (global), grouped by the pattern's period."""
    letters = "".join(
        "S" if config.layer_window(i) is not None else "G" for i in range(config.num_layers)
    )
    period = next(
        (
            p
            for p in range(1, len(letters) + 1)
            if all(letters[i] == letters[i % p] for i in range(len(letters)))
        ),
        len(letters),
    )
    width = period if 1 < period <= len(letters) // 2 else 8  # a pattern seen at least twice
    return " ".join(letters[i : i + width] for i in range(0, len(letters), width))


def family_lines(config: ModelConfig) -> list[str]:
    """`key: description` lines for a decoder config (empty for an encoder)."""
    if not config.is_decoder:
        return []
    sliding = [i for i in range(config.num_layers) if config.layer_window(i) is not None]
    if not sliding:
        layers = f"all {config.num_layers} attend over the whole context"
    elif len(sliding) == config.num_layers:
        layers = (
            f"all {config.num_layers} attend over a sliding "
            f"window of {config.sliding_window} tokens"
        )
    else:
        layers = (
            f"{len(sliding)} sliding (window {config.sliding_window}), "
            f"{config.num_layers - len(sliding)} global: {layer_pattern(config)}"
        )
    rope = f"base {_number(config.rope_theta)}"
    if config.rope_local_theta is not None and sliding:
        rope += f" (global layers), {_number(config.rope_local_theta)} (sliding layers)"
    if config.rope_scaling is not None:
        rope += f", {config.rope_scaling.kind} scaling x{config.rope_scaling.factor:g}"
    norms = f"RMSNorm (eps {config.norm_eps:g}) before attention and MLP"
    if config.sandwich_norms:
        norms += ", and on their outputs"
    if config.qk_norm:
        norms += "; per-head RMSNorm on queries and keys"
    scale = f"{config.softmax_scale:g}" + (
        "" if config.attention_scale is None else " (set by the family)"
    )
    lines = [
        f"layers: {layers}",
        f"attention: {config.num_heads} query heads, {config.num_kv_heads} "
        f"key/value heads of {config.head_dim}, softmax scale {scale}",
        f"rope: {rope}",
        f"norms: {norms}",
        f"mlp: {_MLPS.get(config.activation, config.activation)}, {config.intermediate_size} wide",
    ]
    embedding = "tied to the output head" if config.tie_word_embeddings else "separate output head"
    if config.embedding_scale != 1.0:
        embedding = f"scaled by {config.embedding_scale:.4g}, " + embedding
    lines.append(f"embedding: {embedding}")
    return lines
