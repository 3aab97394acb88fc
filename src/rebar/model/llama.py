"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM) in plain PyTorch.

`forward(input_ids, positions, attn_meta, kv_cache)` takes a flattened batch of tokens from any
number of sequences; `attn_meta` says which sequence each token belongs to and where its K/V live.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rebar.kernels.attention import AttentionMetadata, KVCache
from rebar.kernels.backends import AttentionBackend, get_attention_backend
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
    """Q/K/V projections, RoPE, paged attention through `backend`, output projection."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.backend = backend
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        self.sliding_window = config.sliding_window
        hidden, q_size, kv_size = config.hidden_size, config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        self.q_proj = nn.Linear(hidden, q_size, bias=config.qkv_bias)
        self.k_proj = nn.Linear(hidden, kv_size, bias=config.qkv_bias)
        self.v_proj = nn.Linear(hidden, kv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(q_size, hidden, bias=config.o_bias)

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
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = self.backend(q, k, v, key_cache, value_cache, attn_meta, self.scale, self.sliding_window)
        return self.o_proj(out.reshape(num_tokens, -1))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden, inner = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(hidden, inner, bias=config.mlp_bias)
        self.up_proj = nn.Linear(hidden, inner, bias=config.mlp_bias)
        self.down_proj = nn.Linear(inner, hidden, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_proj(x), self.up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, attention_backend: AttentionBackend) -> None:
        super().__init__()
        self.input_norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.attn = Attention(config, attention_backend)
        self.post_attn_norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, attn_meta, key_cache, value_cache) -> torch.Tensor:
        x = x + self.attn(self.input_norm(x), cos, sin, attn_meta, key_cache, value_cache)
        return x + self.mlp(self.post_attn_norm(x))


class LlamaModel(nn.Module):
    """Decoder-only transformer; weights arrive through `load_state_dict(assign=True)`.

    `rope_freq_factors` (from GGUF `rope_freqs`) divide the RoPE frequencies when present.
    `attention_backend` names an entry of `rebar.kernels.backends.ATTENTION_BACKENDS`; it is
    resolved once here (an unknown name raises InvalidRequestError) and shared by every layer.
    """

    def __init__(
        self, config: ModelConfig, rope_freq_factors: torch.Tensor | None = None, attention_backend: str = "torch"
    ) -> None:
        super().__init__()
        self.config = config
        self.attention_backend = attention_backend
        backend = get_attention_backend(attention_backend)
        self.embed_tokens = uninitialized.embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, backend) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        inv_freq = inverse_frequencies(config, rope_freq_factors)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
        attn_meta: AttentionMetadata,
        kv_cache: KVCache,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        x = self.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(self.inv_freq, positions, x.dtype)
        for index, layer in enumerate(self.layers):
            x = layer(x, cos, sin, attn_meta, kv_cache.keys[index], kv_cache.values[index])
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, vocab] float32
        if self.lm_head is None:  # tied to the input embedding
            return F.linear(hidden, self.embed_tokens.weight).float()
        return self.lm_head(hidden).float()
