"""Rotary position embeddings in the half-split layout (HF's `rotate_half`): the rotation speeds and
the per-position tables. The rotation itself is a kernel
(rebar.kernels.cpu_elementwise.apply_rope)."""

from __future__ import annotations

import math

import torch

from rebar.model.config import ModelConfig, RopeScaling


def inverse_frequencies(
    config: ModelConfig, freq_factors: torch.Tensor | None = None, local: bool = False
) -> torch.Tensor:
    """[head_dim // 2] float32 rotation speeds, after rope scaling and per-frequency factors;
    `local`: those of the sliding-window layers (`rope_local_theta`, unscaled, as Gemma 3's local
    layers)."""
    # An explicit device keeps this real even when the model is built under `torch.device("meta")`.
    exponents = (
        torch.arange(0, config.head_dim, 2, dtype=torch.float64, device="cpu") / config.head_dim
    )
    if local:
        assert config.rope_local_theta is not None, "only a model with local layers asks"
        return (1.0 / (config.rope_local_theta**exponents)).float()
    inv_freq = 1.0 / (config.rope_theta**exponents)
    if config.rope_scaling is not None:
        inv_freq = _scale(inv_freq, config.rope_scaling)
    if freq_factors is not None:  # GGUF stores llama3-style scaling as explicit factors
        inv_freq = inv_freq / freq_factors.to(torch.float64)
    return inv_freq.float()


def _scale(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    # llama3: long wavelengths slowed by `factor`, short ones kept, a smooth blend in between.
    low_wavelen = scaling.original_max_position / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, blended, scaled)


def rope_cos_sin(
    inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, each [num_tokens, head_dim], computed in float32 and cast to `dtype`."""
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)
