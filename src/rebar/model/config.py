"""The frozen description of a model's shape, read from GGUF metadata or an HF config.json."""

from __future__ import annotations

from dataclasses import dataclass

ACTIVATIONS = ("silu", "gelu_tanh")


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

    `architecture` is "llama" (the Llama family of decoders: Llama, Mistral, Qwen2/3, SmolLM, Gemma 3,
    Phi-3) or "bert" (encoder). Decoder-only fields that do not apply to BERT keep their defaults, and
    vice versa; the family's variations are flags whose defaults are Llama's.
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
    # Family variations. `sliding_layers[i]` says whether layer i attends over the sliding window
    # (None: every layer does when `sliding_window` is set); those layers rotate with
    # `rope_local_theta` when it is set (Gemma 3: local layers at 10,000, global ones at rope_theta).
    sliding_layers: tuple[bool, ...] | None = None
    rope_local_theta: float | None = None
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (Qwen 3, Gemma 3)
    sandwich_norms: bool = False  # norms on the attention's and the MLP's outputs too (Gemma 3)
    activation: str = "silu"  # of the gated MLP: "silu" (SwiGLU) or "gelu_tanh" (GeGLU, Gemma)
    embedding_scale: float = 1.0  # multiplies the token embeddings (Gemma: sqrt(hidden_size))
    attention_scale: float | None = None  # softmax scale of q.k; None: head_dim ** -0.5
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
            if self.sliding_layers is not None and len(self.sliding_layers) != self.num_layers:
                raise ValueError(f"sliding_layers has {len(self.sliding_layers)} entries for {self.num_layers} layers")
            if self.activation not in ACTIVATIONS:
                raise ValueError(f"activation must be one of {ACTIVATIONS}, got {self.activation!r}")

    @property
    def is_decoder(self) -> bool:
        return self.architecture == "llama"

    def layer_window(self, layer: int) -> int | None:
        """The sliding window layer `layer` attends over, or None for the whole context."""
        if self.sliding_window is None or (self.sliding_layers is not None and not self.sliding_layers[layer]):
            return None
        return self.sliding_window

    def layer_is_local(self, layer: int) -> bool:
        """Whether layer `layer` rotates with `rope_local_theta` (a sliding layer, when that is set)."""
        return self.rope_local_theta is not None and self.layer_window(layer) is not None

    @property
    def softmax_scale(self) -> float:
        return self.attention_scale if self.attention_scale is not None else self.head_dim**-0.5
