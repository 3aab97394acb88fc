"""Tiny GGUF files for tests, written with `gguf.GGUFWriter` the way llama.cpp's converter writes
them.

A model starts as random weights under Hugging Face names (`random_hf_state`), becomes GGUF tensors
under llama.cpp names (`gguf_tensors`: Q/K rows permuted for the `llama` architecture, 1-D tensors
kept in F32, 2-D tensors in the requested storage type) and is written with its metadata and a
byte-level BPE vocabulary by `GGUFContents.write`. Tests edit a `GGUFContents` before writing it to
produce broken or unsupported files.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import GGUFValueType, GGUFWriter, quants
from kquant_encode import ENCODERS, encode_k

TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_CONTROL = 3

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
MERGES = ("Ġ t", "h e", "Ġt he", "i n", "Ġ a", "Ġa n", "Ġan d", "e r", "o n")


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, the alphabet of every byte-level BPE vocabulary."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {byte: chr(char) for byte, char in zip(printable, chars)}


@dataclass(frozen=True)
class Vocab:
    """A byte-level BPE vocabulary as GGUF stores it: all 256 byte tokens, merged tokens, specials."""

    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    bos_id: int
    eos_id: int

    def id(self, token: str) -> int:
        return self.tokens.index(token)


def byte_level_vocab() -> Vocab:
    alphabet = bytes_to_unicode()
    byte_tokens = [alphabet[b] for b in range(256)]
    merged = ["".join(pair.split(" ")) for pair in MERGES]
    tokens = byte_tokens + merged + list(SPECIAL_TOKENS)
    types = [TOKEN_TYPE_NORMAL] * (len(byte_tokens) + len(merged)) + [TOKEN_TYPE_CONTROL] * len(
        SPECIAL_TOKENS
    )
    bos = eos = tokens.index("<|endoftext|>")
    return Vocab(tokens, types, list(MERGES), bos, eos)


def vocab_metadata(vocab: Vocab, model: str = "gpt2", pre: str = "default") -> dict[str, Any]:
    return {
        "tokenizer.ggml.model": model,
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": vocab.tokens,
        "tokenizer.ggml.token_type": vocab.token_types,
        "tokenizer.ggml.merges": vocab.merges,
        "tokenizer.ggml.bos_token_id": vocab.bos_id,
        "tokenizer.ggml.eos_token_id": vocab.eos_id,
        "tokenizer.ggml.add_bos_token": False,
    }


@dataclass(frozen=True)
class TinyConfig:
    """The shape of a tiny Llama-family model, shared by the GGUF file and the HF reference."""

    arch: str = "llama"  # GGUF architecture: "llama" or "qwen2"
    vocab_size: int = len(byte_level_vocab().tokens)
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    layers: int = 2
    intermediate: int = 128
    context: int = 64
    eps: float = 1e-5
    theta: float = 10000.0
    tied: bool = False

    @property
    def qkv_bias(self) -> bool:
        return self.arch == "qwen2"

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def hf_config(self) -> Any:
        """The matching transformers config (LlamaConfig or Qwen2Config)."""
        from transformers import LlamaConfig, Qwen2Config

        common = dict(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden,
            intermediate_size=self.intermediate,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            max_position_embeddings=self.context,
            rms_norm_eps=self.eps,
            rope_theta=self.theta,
            tie_word_embeddings=self.tied,
        )
        if self.arch == "qwen2":
            return Qwen2Config(**common)
        return LlamaConfig(**common)


def random_hf_state(cfg: TinyConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Random float32 weights under HF names, large enough that attention and RoPE matter."""
    rng = np.random.default_rng(seed)
    q_size, kv_size = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim

    def normal(*shape: int, std: float = 0.15) -> np.ndarray:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    def norm_weight() -> np.ndarray:
        return (1.0 + rng.standard_normal(cfg.hidden) * 0.2).astype(np.float32)

    state = {"model.embed_tokens.weight": normal(cfg.vocab_size, cfg.hidden, std=1.0)}
    for i in range(cfg.layers):
        p = f"model.layers.{i}."
        state[p + "self_attn.q_proj.weight"] = normal(q_size, cfg.hidden, std=0.3)
        state[p + "self_attn.k_proj.weight"] = normal(kv_size, cfg.hidden, std=0.3)
        state[p + "self_attn.v_proj.weight"] = normal(kv_size, cfg.hidden)
        state[p + "self_attn.o_proj.weight"] = normal(cfg.hidden, q_size)
        if cfg.qkv_bias:
            state[p + "self_attn.q_proj.bias"] = normal(q_size, std=0.5)
            state[p + "self_attn.k_proj.bias"] = normal(kv_size, std=0.5)
            state[p + "self_attn.v_proj.bias"] = normal(kv_size, std=0.5)
        state[p + "mlp.gate_proj.weight"] = normal(cfg.intermediate, cfg.hidden)
        state[p + "mlp.up_proj.weight"] = normal(cfg.intermediate, cfg.hidden)
        state[p + "mlp.down_proj.weight"] = normal(cfg.hidden, cfg.intermediate)
        state[p + "input_layernorm.weight"] = norm_weight()
        state[p + "post_attention_layernorm.weight"] = norm_weight()
    state["model.norm.weight"] = norm_weight()
    if not cfg.tied:
        state["lm_head.weight"] = normal(cfg.vocab_size, cfg.hidden)
    return state


_HF_TO_GGUF_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_HF_TO_GGUF_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def gguf_name(hf_name: str) -> str:
    if hf_name in _HF_TO_GGUF_GLOBAL:
        return _HF_TO_GGUF_GLOBAL[hf_name]
    _, _, index, rest = hf_name.split(".", 3)
    return f"blk.{index}.{_HF_TO_GGUF_LAYER[rest]}"


def permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's `LlamaModel.permute`: each head's rows go from half-split to interleaved pairs."""
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def storage_type(values: np.ndarray, storage: QT) -> QT:
    """What the converter stores a tensor as: 1-D tensors stay F32, the rest use `storage`."""
    return QT.F32 if values.ndim == 1 else storage


def encode(values: np.ndarray, qtype: QT) -> np.ndarray:
    """The array GGUFWriter writes for float32 `values` stored as `qtype`."""
    values = np.ascontiguousarray(values, dtype=np.float32)
    if qtype == QT.F32:
        return values
    if qtype == QT.F16:
        return values.astype(np.float16)
    if qtype.name in ENCODERS:  # K-quants, which gguf only decodes
        return encode_k(values, qtype.name)
    return quants.quantize(values, qtype)


def stored_values(values: np.ndarray, qtype: QT) -> np.ndarray:
    """`values` after a round trip through `qtype`, as float32: what a correct loader reads back."""
    data = encode(values, qtype)
    if qtype in (QT.F32, QT.F16):
        return data.astype(np.float32)
    return quants.dequantize(data, qtype)


@dataclass
class Tensor:
    """A tensor as it will be written: `data` is float32/float16, or uint8 bytes of a GGML type."""

    data: np.ndarray
    qtype: QT


def gguf_tensors(
    state: Mapping[str, np.ndarray],
    cfg: TinyConfig,
    storage: QT = QT.F32,
    permute_qk: bool | None = None,
) -> dict[str, Tensor]:
    """HF weights -> llama.cpp tensors; Q/K rows are permuted for `llama` unless `permute_qk` says
    otherwise."""
    if permute_qk is None:
        permute_qk = cfg.arch == "llama"
    tensors = {}
    for hf_name, values in state.items():
        if permute_qk and ".q_proj." in hf_name:
            values = permute(values, cfg.heads)
        elif permute_qk and ".k_proj." in hf_name:
            values = permute(values, cfg.kv_heads)
        qtype = storage_type(values, storage)
        tensors[gguf_name(hf_name)] = Tensor(encode(values, qtype), qtype)
    return tensors


def model_metadata(cfg: TinyConfig, vocab: Vocab) -> dict[str, Any]:
    """The keys llama.cpp's converter writes for a Llama/Qwen2 model (general.architecture comes
    from the writer)."""
    a = cfg.arch
    meta: dict[str, Any] = {
        "general.name": f"tiny-{a}",
        f"{a}.block_count": cfg.layers,
        f"{a}.context_length": cfg.context,
        f"{a}.embedding_length": cfg.hidden,
        f"{a}.feed_forward_length": cfg.intermediate,
        f"{a}.attention.head_count": cfg.heads,
        f"{a}.attention.head_count_kv": cfg.kv_heads,
        f"{a}.rope.freq_base": cfg.theta,
        f"{a}.attention.layer_norm_rms_epsilon": cfg.eps,
    }
    if a == "llama":
        meta[f"{a}.vocab_size"] = cfg.vocab_size
        meta[f"{a}.rope.dimension_count"] = cfg.head_dim
    meta.update(vocab_metadata(vocab))
    return meta


@dataclass
class GGUFContents:
    """Everything in a GGUF file; edit the fields, then `write`."""

    arch: str | None
    metadata: dict[str, Any]
    tensors: dict[str, Tensor] = field(default_factory=dict)
    alignment: int | None = None

    def write(self, path: Path) -> Path:
        writer = GGUFWriter(path, self.arch or "unused")
        if self.arch is None:
            del writer.kv_data[0]["general.architecture"]
        if self.alignment is not None:
            writer.add_custom_alignment(self.alignment)
        for key, value in self.metadata.items():
            _add_value(writer, key, value)
        for name, tensor in self.tensors.items():
            writer.add_tensor(
                name,
                tensor.data,
                raw_dtype=None if tensor.qtype in (QT.F32, QT.F16) else tensor.qtype,
            )
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return path


@dataclass(frozen=True)
class Typed:
    """A metadata value written as an explicit GGUF type (a negative INT32, an infinite FLOAT32,
    ...)."""

    value: Any
    vtype: GGUFValueType
    sub_type: GGUFValueType | None = None


def _add_value(writer: GGUFWriter, key: str, value: Any) -> None:
    if isinstance(value, Typed):
        writer.add_key_value(key, value.value, value.vtype, value.sub_type)
    elif isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    elif isinstance(value, list):
        writer.add_array(key, value)
    else:
        raise TypeError(f"no GGUF type for {key}={value!r}")


def model_contents(
    cfg: TinyConfig,
    state: Mapping[str, np.ndarray] | None = None,
    storage: QT = QT.F32,
    permute_qk: bool | None = None,
) -> GGUFContents:
    """A complete GGUF model file's contents: metadata, vocabulary and converted weights."""
    vocab = byte_level_vocab()
    assert cfg.vocab_size == len(vocab.tokens)
    state = random_hf_state(cfg) if state is None else state
    return GGUFContents(
        cfg.arch, model_metadata(cfg, vocab), gguf_tensors(state, cfg, storage, permute_qk)
    )
