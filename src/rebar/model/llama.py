"""Llama-family decoder (Llama 2/3, Mistral, Qwen 2/3, SmolLM, Gemma 3, Phi-3) in plain PyTorch.

`forward(input_ids, positions, attn_meta, kv_cache)` takes a flattened batch of tokens from any
number of sequences; `attn_meta` says which sequence each token belongs to and where its K/V live.

The family's variations are the config's flags (model/config.py): RMSNorm of q and k per head
(Qwen 3, Gemma 3); norms on the attention's and MLP's outputs as well as their inputs, GeGLU, a
scaled embedding, and sliding-window layers interleaved with global ones, each kind with its own
RoPE base (Gemma 3). Phi-3's fused q/k/v and gate/up weights are split by the loaders.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from rebar.kernels.attention import AttentionMetadata, KVCache
from rebar.kernels.backends import AttentionBackend, get_attention_backend
from rebar.kernels.best_logits import BestTokens, best_logits
from rebar.kernels.cpu_elementwise import apply_rope, silu_and_mul
from rebar.model import uninitialized
from rebar.model.config import ModelConfig
from rebar.model.rope import inverse_frequencies, rope_cos_sin


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 (as the reference implementations do), scale in the model dtype.
        # F.rms_norm is one fused op: five element-wise ops here cost more than the maths at decode.
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)


class Attention(nn.Module):
    """Q/K/V projections, (q/k norms,) RoPE, paged attention through `backend`, output
    projection."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend, layer: int) -> None:
        super().__init__()
        self.backend = backend
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.softmax_scale
        self.sliding_window = config.layer_window(layer)
        hidden, q_size, kv_size = (
            config.hidden_size,
            config.num_heads * config.head_dim,
            config.num_kv_heads * config.head_dim,
        )
        self.q_proj = nn.Linear(hidden, q_size, bias=config.qkv_bias)
        self.k_proj = nn.Linear(hidden, kv_size, bias=config.qkv_bias)
        self.v_proj = nn.Linear(hidden, kv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(q_size, hidden, bias=config.o_bias)
        self.q_norm = RMSNorm(config.head_dim, config.norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.norm_eps) if config.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn_meta: AttentionMetadata,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        q = self.q_proj(x).view(num_tokens, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q).contiguous(), self.k_norm(k).contiguous()
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = self.backend(
            q, k, v, key_cache, value_cache, attn_meta, self.scale, self.sliding_window
        )
        return self.o_proj(out.reshape(num_tokens, -1))


class MLP(nn.Module):
    """The gated MLP: down(act(gate(x)) * up(x)), act SiLU (SwiGLU) or tanh-approximated GELU
    (GeGLU)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden, inner = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(hidden, inner, bias=config.mlp_bias)
        self.up_proj = nn.Linear(hidden, inner, bias=config.mlp_bias)
        self.down_proj = nn.Linear(inner, hidden, bias=config.mlp_bias)
        self.activation = config.activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)
        if self.activation == "gelu_tanh":
            return self.down_proj(F.gelu(gate, approximate="tanh") * up)
        return self.down_proj(silu_and_mul(gate, up))


class DecoderLayer(nn.Module):
    """Pre-norm residual blocks; with `sandwich_norms` the attention's and MLP's outputs are normed
    too before they join the residual stream (Gemma 3)."""

    def __init__(
        self, config: ModelConfig, attention_backend: AttentionBackend, layer: int
    ) -> None:
        super().__init__()
        self.input_norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.attn = Attention(config, attention_backend, layer)
        self.post_attn_norm = RMSNorm(config.hidden_size, config.norm_eps)  # the MLP's input norm
        self.mlp = MLP(config)
        self.attn_out_norm = (
            RMSNorm(config.hidden_size, config.norm_eps) if config.sandwich_norms else None
        )
        self.mlp_out_norm = (
            RMSNorm(config.hidden_size, config.norm_eps) if config.sandwich_norms else None
        )

    def forward(self, x, cos, sin, attn_meta, key_cache, value_cache) -> torch.Tensor:
        h = self.attn(self.input_norm(x), cos, sin, attn_meta, key_cache, value_cache)
        x = x + (h if self.attn_out_norm is None else self.attn_out_norm(h))
        h = self.mlp(self.post_attn_norm(x))
        return x + (h if self.mlp_out_norm is None else self.mlp_out_norm(h))


class LlamaModel(nn.Module):
    """Decoder-only transformer; weights arrive through `load_state_dict(assign=True)`.

    `rope_freq_factors` (from GGUF `rope_freqs`) divide the RoPE frequencies when present.
    `attention_backend` names an entry of `rebar.kernels.backends.ATTENTION_BACKENDS`; it is
    resolved once here (an unknown name raises InvalidRequestError) and shared by every layer.
    """

    inv_freq: torch.Tensor  # buffers, registered in __init__
    inv_freq_local: torch.Tensor

    def __init__(
        self,
        config: ModelConfig,
        rope_freq_factors: torch.Tensor | None = None,
        attention_backend: str = "torch",
    ) -> None:
        super().__init__()
        self.config = config
        self.attention_backend = attention_backend
        backend = get_attention_backend(attention_backend)
        self.embed_tokens = uninitialized.embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, backend, i) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        inv_freq = inverse_frequencies(config, rope_freq_factors)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        # The sliding-window layers' own RoPE base (Gemma 3), else the same speeds.
        local = (
            inverse_frequencies(config, local=True)
            if config.rope_local_theta is not None
            else inv_freq
        )
        self.register_buffer("inv_freq_local", local, persistent=False)
        self.is_local = [config.layer_is_local(i) for i in range(config.num_layers)]

    def decoder_layers(self) -> list[DecoderLayer]:
        """`layers` with their type (iterating an nn.ModuleList gives plain Modules)."""
        return [cast(DecoderLayer, layer) for layer in self.layers]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The token embeddings, scaled as the family does (Gemma: by sqrt(hidden_size))."""
        x = self.embed_tokens(input_ids)
        return x if self.config.embedding_scale == 1.0 else x * self.config.embedding_scale

    def rope_tables(self, positions: torch.Tensor, dtype: torch.dtype):
        """(cos, sin) of the global layers and of the local ones (the same tables when they share a
        base)."""
        tables = rope_cos_sin(self.inv_freq, positions, dtype)
        if not any(self.is_local):
            return tables, tables
        return tables, rope_cos_sin(self.inv_freq_local, positions, dtype)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
        attn_meta: AttentionMetadata,
        kv_cache: KVCache,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        x = self.embed(input_ids)
        tables = self.rope_tables(positions, x.dtype)
        for index, layer in enumerate(self.layers):
            cos, sin = tables[self.is_local[index]]
            x = layer(x, cos, sin, attn_meta, kv_cache.keys[index], kv_cache.values[index])
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, vocab] float32
        if self.lm_head is None:  # tied to the input embedding
            return F.linear(hidden, self.embed_tokens.weight).float()
        return self.lm_head(hidden).float()

    def best_tokens(self, hidden: torch.Tensor) -> BestTokens:
        """Each row's greedy token, as `best_logits(self.compute_logits(hidden))` finds it; a
        quantized head (a QuantLinear's `best_outputs`) finds it without writing the logits."""
        best_outputs = getattr(self.lm_head, "best_outputs", None)
        if best_outputs is not None:
            return best_outputs(hidden)
        return best_logits(self.compute_logits(hidden))
