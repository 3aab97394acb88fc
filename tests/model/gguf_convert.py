"""transformers Qwen3 / Gemma 3 / Phi-3 models -> GGUF files, the way llama.cpp's converter writes
them.

What the converter does per family (convert_hf_to_gguf.py): tensor names in llama.cpp's scheme,
Gemma's norm weights stored plus one (its RMSNorm multiplies by 1 + w), Phi-3's fused q/k/v and
gate/up kept fused, no Q/K row permutation (these families use the half-split RoPE layout), and the
family's metadata keys. The vocabulary is gguf_builder's byte-level BPE one.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType as QT
from gguf_builder import (
    GGUFContents,
    Tensor,
    byte_level_vocab,
    encode,
    storage_type,
    vocab_metadata,
)

_GGUF_ARCH = {"Qwen3ForCausalLM": "qwen3", "Gemma3ForCausalLM": "gemma3", "Phi3ForCausalLM": "phi3"}
_LAYER_NAMES = {
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.qkv_proj.weight": "attn_qkv.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.gate_up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "input_layernorm.weight": "attn_norm.weight",
}
_NORMS = {  # per family: HF's post-attention name differs in meaning
    "qwen3": {"post_attention_layernorm.weight": "ffn_norm.weight"},
    "phi3": {"post_attention_layernorm.weight": "ffn_norm.weight"},
    "gemma3": {
        "post_attention_layernorm.weight": "post_attention_norm.weight",
        "pre_feedforward_layernorm.weight": "ffn_norm.weight",
        "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
    },
}


def gguf_name(hf_name: str, arch: str) -> str:
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    if hf_name == "lm_head.weight":
        return "output.weight"
    _, _, index, rest = hf_name.split(".", 3)
    return f"blk.{index}.{_NORMS[arch].get(rest) or _LAYER_NAMES[rest]}"


def metadata(model: torch.nn.Module, arch: str) -> dict[str, Any]:
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    meta: dict[str, Any] = {
        "general.name": f"tiny-{arch}",
        f"{arch}.block_count": c.num_hidden_layers,
        f"{arch}.context_length": c.max_position_embeddings,
        f"{arch}.embedding_length": c.hidden_size,
        f"{arch}.feed_forward_length": c.intermediate_size,
        f"{arch}.attention.head_count": c.num_attention_heads,
        f"{arch}.attention.head_count_kv": c.num_key_value_heads,
        f"{arch}.attention.key_length": head_dim,
        f"{arch}.attention.value_length": head_dim,
        f"{arch}.attention.layer_norm_rms_epsilon": float(c.rms_norm_eps),
        f"{arch}.rope.dimension_count": head_dim,
    }
    rope = c.rope_parameters
    global_rope = rope.get("full_attention", rope)
    meta[f"{arch}.rope.freq_base"] = float(global_rope["rope_theta"])
    if arch == "gemma3" and c.sliding_window:
        meta["gemma3.attention.sliding_window"] = int(c.sliding_window)
        pattern = [kind == "sliding_attention" for kind in c.layer_types]
        if pattern != [
            i % 6 < 5 for i in range(c.num_hidden_layers)
        ]:  # not llama.cpp's default period
            meta["gemma3.attention.sliding_window_pattern"] = pattern
        meta["gemma3.rope.freq_base_swa"] = float(rope["sliding_attention"]["rope_theta"])
    meta.update(vocab_metadata(byte_level_vocab()))
    return meta


def convert(model: torch.nn.Module, storage: QT = QT.F32) -> GGUFContents:
    """`model`'s weights and metadata as llama.cpp writes them (`storage` for the 2-D tensors)."""
    arch = _GGUF_ARCH[type(model).__name__]
    assert model.config.vocab_size == len(byte_level_vocab().tokens)
    tensors = {}
    for hf_name, param in model.state_dict().items():
        if hf_name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        values = param.detach().float().numpy()
        if arch == "gemma3" and hf_name.endswith("norm.weight"):
            values = values + np.float32(1.0)
        qtype = storage_type(values, storage)
        tensors[gguf_name(hf_name, arch)] = Tensor(encode(values, qtype), qtype)
    return GGUFContents(arch, metadata(model, arch), tensors)
