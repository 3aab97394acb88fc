"""The frozen description of a model's shape, read from GGUF metadata or an HF config.json."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. `kind` is "linear" or "llama3" (the two rebar implements)."""

    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """Everything the model math needs; loaders build it, nothing mutates it.

    `architecture` is "llama" (Llama, Mistral, Qwen2, SmolLM: decoder-only) or "bert" (encoder).
    Decoder-only fields that do not apply to BERT keep their defaults, and vice versa.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_position_embeddings: int
    norm_eps: float
    # Decoder-only (Llama family).
    num_kv_heads: int = 0
    head_dim: int = 0
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    # Encoder-only (BERT).
    type_vocab_size: int = 0
    pooling: str = "mean"
    normalize_embeddings: bool = True
    max_seq_length: int = 0
    # Provenance for `rebar inspect`: the name the checkpoint gives itself, if any.
    name: str = ""
    source_architecture: str = ""

    def __post_init__(self) -> None:
        if self.architecture == "llama":
            if self.num_kv_heads <= 0 or self.num_heads % self.num_kv_heads != 0:
                raise ValueError(
                    f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
                )
            if self.head_dim <= 0 or self.head_dim % 2 != 0:
                raise ValueError(f"head_dim must be a positive even number, got {self.head_dim}")

    @property
    def is_decoder(self) -> bool:
        return self.architecture == "llama"
