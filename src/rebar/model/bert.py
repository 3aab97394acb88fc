"""BERT encoder for sentence embeddings (all-MiniLM and friends) in plain PyTorch.

Module names mirror Hugging Face's BertModel so checkpoint names map one-to-one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rebar.model import uninitialized
from rebar.model.config import ModelConfig


class BertEmbeddings(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.word_embeddings = uninitialized.embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = uninitialized.embedding(
            config.max_position_embeddings, config.hidden_size
        )
        self.token_type_embeddings = uninitialized.embedding(
            config.type_vocab_size, config.hidden_size
        )
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.norm_eps)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = (
            self.word_embeddings(input_ids)
            + self.position_embeddings(positions)[None]
            + self.token_type_embeddings(token_type_ids)
        )
        return self.LayerNorm(x)


class BertSelfAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.query = nn.Linear(config.hidden_size, config.hidden_size)
        self.key = nn.Linear(config.hidden_size, config.hidden_size)
        self.value = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:  # [batch, heads, seq, head_dim]
            return t.view(batch, seq, self.num_heads, -1).transpose(1, 2)

        out = F.scaled_dot_product_attention(
            heads(self.query(x)), heads(self.key(x)), heads(self.value(x)), attn_mask=mask
        )
        return out.transpose(1, 2).reshape(batch, seq, hidden)


class BertDenseLayerNorm(nn.Module):
    """dense -> residual add -> LayerNorm (HF's BertSelfOutput / BertOutput)."""

    def __init__(self, in_size: int, out_size: int, eps: float) -> None:
        super().__init__()
        self.dense = nn.Linear(in_size, out_size)
        self.LayerNorm = nn.LayerNorm(out_size, eps=eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class BertAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.self = BertSelfAttention(config)
        self.output = BertDenseLayerNorm(config.hidden_size, config.hidden_size, config.norm_eps)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.output(self.self(x, mask), x)


class BertIntermediate(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.dense(x))  # exact (erf) GELU, as BERT's "gelu"


class BertLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.attention = BertAttention(config)
        self.intermediate = BertIntermediate(config)
        self.output = BertDenseLayerNorm(
            config.intermediate_size, config.hidden_size, config.norm_eps
        )

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        attended = self.attention(x, mask)
        return self.output(self.intermediate(attended), attended)


class BertEncoder(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config) for _ in range(config.num_layers))


class BertModel(nn.Module):
    """Encoder + pooling. `embed` returns one vector per input row, L2-normalised when
    configured."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embeddings = BertEmbeddings(config)
        self.encoder = BertEncoder(config)

    def forward(
        self,
        input_ids: torch.Tensor,  # [batch, seq] int64, right-padded
        attention_mask: torch.Tensor,  # [batch, seq] 1 for real tokens, 0 for padding
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:  # [batch, seq, hidden]
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        x = self.embeddings(input_ids, token_type_ids)
        keys_allowed = attention_mask.bool()[:, None, None, :]  # broadcast over heads and queries
        for layer in self.encoder.layer:
            x = layer(x, keys_allowed)
        return x

    def embed(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> torch.Tensor:  # [batch, hidden] float32
        hidden = self.forward(input_ids, attention_mask).float()
        if self.config.pooling == "cls":
            pooled = hidden[:, 0]
        else:
            weights = attention_mask.to(hidden.dtype)[:, :, None]
            pooled = (hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)
        return F.normalize(pooled, p=2, dim=-1) if self.config.normalize_embeddings else pooled
