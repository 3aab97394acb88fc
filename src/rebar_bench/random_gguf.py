"""Random-weight Llama-shaped GGUF files of any size, for speed and memory benchmarks.

Speed does not depend on weight values, so a benchmark can measure a 1 B model without one: this
writes an F16 GGUF of the requested shape with random weights and the bundled SmolLM2's tokenizer
(byte-level BPE, 49,152 tokens; the embedding is tied to the output, as SmolLM2's), and llama.cpp's
own `llama-quantize` turns it into the type under test (Q4_K_M, ...), exactly as a user's file is
made. Used by `rebar bench make-model`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

# Shapes by name: the 1 B one is 2,048 hidden, 16 layers, 32 heads, 8 KV heads, 8,192 FFN (1.07 B
# parameters with the tied 49,152-token embedding; 638 MiB as Q4_K_M). The 135 M one is SmolLM2's
# shape: with the same tokenizer, a draft model for the others (rebar bench spec).
SHAPES = {
    "135m": dict(hidden=576, layers=30, heads=9, kv_heads=3, ffn=1536),
    "1b": dict(hidden=2048, layers=16, heads=32, kv_heads=8, ffn=8192),
    "3b": dict(hidden=3072, layers=28, heads=24, kv_heads=8, ffn=8192),
    "8b": dict(hidden=4096, layers=32, heads=32, kv_heads=8, ffn=14336),
}


@dataclass(frozen=True)
class LlamaShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    context: int = 4096

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def num_parameters(self, vocab: int) -> int:
        kv = self.kv_heads * self.head_dim
        per_layer = (
            2 * self.hidden * self.hidden
            + 2 * self.hidden * kv
            + 3 * self.hidden * self.ffn
            + 2 * self.hidden
        )
        return self.layers * per_layer + vocab * self.hidden + self.hidden


def _tokenizer_fields(source: Path) -> dict:
    """The tokenizer metadata of a GGUF file (SmolLM2's, by default)."""
    from rebar.model.loader.gguf_reader import GGUFFile

    meta = GGUFFile(source).metadata
    return {key: value for key, value in meta.items() if key.startswith("tokenizer.")}


def write_random_llama(
    path: Path, shape: LlamaShape, tokenizer_source: Path, seed: int = 0
) -> Path:
    """Write an F16 `llama` GGUF of `shape` with random weights (normal, std 0.02; norms 1) to
    `path`."""
    from gguf import GGUFWriter

    tokenizer = _tokenizer_fields(tokenizer_source)
    vocab = len(tokenizer["tokenizer.ggml.tokens"])
    rng = np.random.default_rng(seed)
    writer = GGUFWriter(str(path), "llama")
    writer.add_name(f"random-llama-{shape.hidden}x{shape.layers}")
    writer.add_block_count(shape.layers)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_file_type(1)  # mostly F16
    writer.add_tokenizer_model(tokenizer["tokenizer.ggml.model"])
    writer.add_tokenizer_pre(tokenizer.get("tokenizer.ggml.pre", "default"))
    writer.add_token_list(tokenizer["tokenizer.ggml.tokens"])
    writer.add_token_types(tokenizer["tokenizer.ggml.token_type"])
    writer.add_token_merges(tokenizer["tokenizer.ggml.merges"])
    for key in ("bos_token_id", "eos_token_id"):
        if f"tokenizer.ggml.{key}" in tokenizer:
            getattr(writer, f"add_{key}")(tokenizer[f"tokenizer.ggml.{key}"])
    if "tokenizer.chat_template" in tokenizer:
        writer.add_chat_template(tokenizer["tokenizer.chat_template"])

    def weight(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float16)

    kv = shape.kv_heads * shape.head_dim
    ones = np.ones(shape.hidden, dtype=np.float32)
    writer.add_tensor("token_embd.weight", weight(vocab, shape.hidden))
    for i in range(shape.layers):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", ones)
        writer.add_tensor(f"blk.{i}.attn_q.weight", weight(shape.hidden, shape.hidden))
        writer.add_tensor(f"blk.{i}.attn_k.weight", weight(kv, shape.hidden))
        writer.add_tensor(f"blk.{i}.attn_v.weight", weight(kv, shape.hidden))
        writer.add_tensor(f"blk.{i}.attn_output.weight", weight(shape.hidden, shape.hidden))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", ones)
        writer.add_tensor(f"blk.{i}.ffn_gate.weight", weight(shape.ffn, shape.hidden))
        writer.add_tensor(f"blk.{i}.ffn_up.weight", weight(shape.ffn, shape.hidden))
        writer.add_tensor(f"blk.{i}.ffn_down.weight", weight(shape.hidden, shape.ffn))
    writer.add_tensor("output_norm.weight", ones)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
