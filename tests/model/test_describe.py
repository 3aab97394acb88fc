"""`rebar inspect`'s description of a decoder's family traits."""

from __future__ import annotations

from dataclasses import replace

from rebar.model.config import ModelConfig, RopeScaling
from rebar.model.describe import family_lines, layer_pattern

BASE = ModelConfig(
    architecture="llama",
    vocab_size=100,
    hidden_size=64,
    num_layers=8,
    num_heads=4,
    intermediate_size=128,
    max_position_embeddings=256,
    norm_eps=1e-6,
    num_kv_heads=2,
    head_dim=16,
)


def lines(config: ModelConfig) -> dict[str, str]:
    return dict(line.split(": ", 1) for line in family_lines(config))


def test_a_plain_llama() -> None:
    got = lines(BASE)
    assert got["layers"] == "all 8 attend over the whole context"
    assert got["attention"] == "4 query heads, 2 key/value heads of 16, softmax scale 0.25"
    assert got["rope"] == "base 10,000"
    assert got["norms"] == "RMSNorm (eps 1e-06) before attention and MLP"
    assert got["mlp"] == "SwiGLU (SiLU-gated), 128 wide"
    assert got["embedding"] == "separate output head"


def test_qwen3_traits() -> None:
    got = lines(replace(BASE, qk_norm=True, rope_theta=1e6, tie_word_embeddings=True))
    assert (
        got["norms"].endswith("; per-head RMSNorm on queries and keys")
        and "outputs" not in got["norms"]
    )
    assert got["rope"] == "base 1,000,000" and got["embedding"] == "tied to the output head"


def test_one_window_for_every_layer_and_rope_scaling() -> None:
    got = lines(replace(BASE, sliding_window=32, rope_scaling=RopeScaling("linear", 2.0)))
    assert got["layers"] == "all 8 attend over a sliding window of 32 tokens"
    assert got["rope"] == "base 10,000, linear scaling x2"


def test_interleaved_windows_show_their_pattern_and_two_rope_bases() -> None:
    pattern = tuple((i + 1) % 4 != 0 for i in range(8))
    gemma = replace(
        BASE,
        sliding_window=32,
        sliding_layers=pattern,
        rope_local_theta=10_000.0,
        rope_theta=1e6,
        sandwich_norms=True,
        activation="gelu_tanh",
        embedding_scale=8.0,
        attention_scale=0.1,
    )
    got = lines(gemma)
    assert got["layers"] == "6 sliding (window 32), 2 global: SSSG SSSG"
    assert got["rope"] == "base 1,000,000 (global layers), 10,000 (sliding layers)"
    assert got["norms"] == "RMSNorm (eps 1e-06) before attention and MLP, and on their outputs"
    assert got["mlp"].startswith("GeGLU") and got["embedding"].startswith("scaled by 8")
    assert got["attention"].endswith("softmax scale 0.1 (set by the family)")
    irregular = replace(gemma, sliding_layers=(True, False, False, True, True, True, False, True))
    assert layer_pattern(irregular) == "SGGSSSGS"


def test_an_encoder_has_no_decoder_traits() -> None:
    bert = ModelConfig(
        architecture="bert",
        vocab_size=100,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        intermediate_size=128,
        max_position_embeddings=64,
        norm_eps=1e-12,
    )
    assert family_lines(bert) == []
