"""The frozen description of a model's shape, read from GGUF metadata or an HF config.json."""

from __future__ import annotations

import math
from dataclasses import dataclass

ACTIVATIONS = ("silu", "gelu_tanh")

# The largest value each dimension may take: well past every published model, small enough that a
# corrupt or hostile file cannot make rebar plan an absurd model (or divide by zero) from its
# numbers.
DIMENSION_LIMITS = {
    "vocab_size": 2**24,
    "hidden_size": 2**20,
    "intermediate_size": 2**20,
    "num_layers": 1024,
    "num_heads": 2**16,
    "num_kv_heads": 2**16,
    "head_dim": 2**16,
    "max_position_embeddings": 2**24,
    "sliding_window": 2**24,
    "type_vocab_size": 2**16,
    "max_seq_length": 2**24,
    "original_max_position": 2**24,
}


def dimension_problem(value: object, field: str) -> str | None:
    """Why `value` cannot be dimension `field` (a key of DIMENSION_LIMITS), or None when it can."""
    limit = DIMENSION_LIMITS[field]
    if isinstance(value, bool) or not isinstance(value, int):
        return "must be an integer"
    if not 1 <= value <= limit:
        return f"must be a positive integer no larger than {limit}"
    return None


def number_problem(value: object) -> str | None:
    """Why `value` cannot be a scale such as an epsilon, a RoPE base or a factor, or None when it
    can."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return "must be a number"
    if (
        isinstance(value, int) and abs(value) > 2**1000
    ):  # beyond float: math.isfinite would raise OverflowError
        return "must be a finite positive number"
    if not math.isfinite(value) or value <= 0:
        return "must be a finite positive number"
    return None


class InvalidModelConfig(ValueError):
    """A ModelConfig field, or a combination of fields, no model can have. `fields` names them, so a
    loader can say which keys of its file they came from."""

    def __init__(self, message: str, *fields: str) -> None:
        super().__init__(message)
        self.fields = fields


def _check_dimension(owner: object, field: str) -> None:
    value = getattr(owner, field)
    problem = dimension_problem(value, field)
    if problem is not None:
        raise InvalidModelConfig(f"{field}={value!r} {problem}", field)


def _check_number(owner: object, field: str) -> None:
    value = getattr(owner, field)
    problem = number_problem(value)
    if problem is not None:
        raise InvalidModelConfig(f"{field}={value!r} {problem}", field)


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. `kind` is "linear" or "llama3" (the two rebar implements)."""

    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192

    def __post_init__(self) -> None:
        for name in ("factor", "low_freq_factor", "high_freq_factor"):
            _check_number(self, name)
        _check_dimension(self, "original_max_position")
        if self.kind == "llama3" and self.low_freq_factor >= self.high_freq_factor:
            # llama3 blends between the two; equal factors would divide by zero
            raise InvalidModelConfig(
                f"low_freq_factor={self.low_freq_factor} must be below "
                f"high_freq_factor={self.high_freq_factor}",
                "low_freq_factor",
                "high_freq_factor",
            )


@dataclass(frozen=True)
class ModelConfig:
    """Everything the model math needs; loaders build it, nothing mutates it.

    `architecture` is "llama" (the Llama family of decoders: Llama, Mistral, Qwen2/3, SmolLM, Gemma
    3, Phi-3) or "bert" (encoder). Decoder-only fields that do not apply to BERT keep their
    defaults, and vice versa; the family's variations are flags whose defaults are Llama's.

    Construction checks what any model must satisfy: every dimension a positive integer within
    DIMENSION_LIMITS, every scale finite and positive, heads that divide evenly, one sliding flag
    per layer. A violation is an InvalidModelConfig naming the fields (loaders translate them to
    their keys).
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
    # `rope_local_theta` when it is set (Gemma 3: local layers at 10,000, global ones at
    # rope_theta).
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
        for name in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "intermediate_size",
            "max_position_embeddings",
        ):
            _check_dimension(self, name)
        _check_number(self, "norm_eps")
        if self.architecture == "llama":
            self._check_decoder()
        elif (
            self.hidden_size % self.num_heads != 0
        ):  # BERT splits the hidden state into equal heads
            raise InvalidModelConfig(
                f"hidden_size={self.hidden_size} is not a multiple of num_heads={self.num_heads}",
                "hidden_size",
                "num_heads",
            )

    def _check_decoder(self) -> None:
        _check_dimension(self, "num_kv_heads")
        _check_dimension(self, "head_dim")
        if self.num_heads % self.num_kv_heads != 0:
            raise InvalidModelConfig(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}",
                "num_heads",
                "num_kv_heads",
            )
        if self.head_dim % 2 != 0:  # RoPE rotates pairs of dimensions
            raise InvalidModelConfig(
                f"head_dim must be a positive even number, got {self.head_dim}", "head_dim"
            )
        for name in ("rope_theta", "embedding_scale"):
            _check_number(self, name)
        for name in ("rope_local_theta", "attention_scale"):
            if getattr(self, name) is not None:
                _check_number(self, name)
        if self.sliding_window is not None:
            _check_dimension(self, "sliding_window")
        if self.sliding_layers is not None and len(self.sliding_layers) != self.num_layers:
            raise InvalidModelConfig(
                f"sliding_layers has {len(self.sliding_layers)} entries for {self.num_layers} "
                "layers",
                "sliding_layers",
                "num_layers",
            )
        if self.activation not in ACTIVATIONS:
            raise InvalidModelConfig(
                f"activation must be one of {ACTIVATIONS}, got {self.activation!r}", "activation"
            )

    @property
    def is_decoder(self) -> bool:
        return self.architecture == "llama"

    def layer_window(self, layer: int) -> int | None:
        """The sliding window layer `layer` attends over, or None for the whole context."""
        if self.sliding_window is None or (
            self.sliding_layers is not None and not self.sliding_layers[layer]
        ):
            return None
        return self.sliding_window

    def layer_is_local(self, layer: int) -> bool:
        """Whether layer `layer` rotates with `rope_local_theta` (a sliding layer, when that is
        set)."""
        return self.rope_local_theta is not None and self.layer_window(layer) is not None

    @property
    def softmax_scale(self) -> float:
        return self.attention_scale if self.attention_scale is not None else self.head_dim**-0.5
