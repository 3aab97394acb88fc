"""Qwen 3, Gemma 3 and Phi-3 GGUF files (written as llama.cpp's converter writes them) against the
transformers model they came from: the same logits, within float32 round-off, on the float path;
the default quantized path close to them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf_convert
import hf_tiny
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf_builder import byte_level_vocab

from float_reference import float_llm
from needs import need_module
from rebar import LLM
from rebar.model.loader import open_checkpoint

need_module("transformers")  # the reference models these tests compare against

VOCAB = len(byte_level_vocab().tokens)
IDS = [(i * 37 + 11) % VOCAB for i in range(36)]

CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3": ("Qwen3ForCausalLM", {"num_key_value_heads": 2, "head_dim": 32}),
    # head_dim as query_pre_attn_scalar (Gemma 3's own configs do; llama.cpp assumes it)
    "gemma3": (
        "Gemma3ForCausalLM",
        {
            "num_hidden_layers": 4,
            "num_key_value_heads": 1,
            "head_dim": 32,
            "query_pre_attn_scalar": 32,
            "sliding_window": 6,
            "layer_types": [
                "sliding_attention",
                "full_attention",
                "sliding_attention",
                "full_attention",
            ],
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
            },
            "tie_word_embeddings": True,
        },
    ),
    "phi3": ("Phi3ForCausalLM", {"num_key_value_heads": 2, "sliding_window": None}),
}


def write(tmp_path: Path, case: str, storage: QT = QT.F32) -> tuple[torch.nn.Module, Path]:
    arch, overrides = CASES[case]
    # 128-wide MLP: every weight's rows are whole blocks of 32 for the quantized files
    model = hf_tiny.build_decoder(
        arch, seed=len(case), vocab_size=VOCAB, intermediate_size=128, **overrides
    )
    return model, gguf_convert.convert(model, storage).write(
        tmp_path / f"{case}-{storage.name}.gguf"
    )


@torch.no_grad()
def hf_logits(model: torch.nn.Module) -> torch.Tensor:
    return model(torch.tensor([IDS])).logits[0].float()


@pytest.mark.parametrize("case", list(CASES))
def test_gguf_logits_match_transformers(tmp_path: Path, case: str) -> None:
    model, path = write(tmp_path, case)
    expected = hf_logits(model)
    assert expected.std() > 0.5
    torch.testing.assert_close(float_llm(path).logits(IDS), expected, atol=1e-4, rtol=0)


def test_family_specifics_are_read_from_the_metadata(tmp_path: Path) -> None:
    qwen3 = open_checkpoint(write(tmp_path, "qwen3")[1]).config
    assert qwen3.source_architecture == "gguf:qwen3" and qwen3.qk_norm and not qwen3.sandwich_norms
    gemma3 = open_checkpoint(write(tmp_path, "gemma3")[1]).config
    assert gemma3.sandwich_norms and gemma3.qk_norm and gemma3.activation == "gelu_tanh"
    assert gemma3.sliding_window == 6 and gemma3.sliding_layers == (True, False, True, False)
    assert gemma3.rope_local_theta == 10000.0 and gemma3.rope_theta == 1e6
    assert gemma3.embedding_scale == pytest.approx(
        64**0.5
    ) and gemma3.attention_scale == pytest.approx(32**-0.5)
    phi3 = open_checkpoint(write(tmp_path, "phi3")[1])
    assert phi3.tensors["layers.0.attn.k_proj.weight"].file_name == "blk.0.attn_qkv.weight"
    assert phi3.tensors["layers.0.mlp.up_proj.weight"].shape == (
        phi3.config.intermediate_size,
        phi3.config.hidden_size,
    )


@pytest.mark.parametrize("case", list(CASES))
def test_quantized_files_run_on_rebars_kernels(tmp_path: Path, case: str) -> None:
    """Q8_0 weights (every family's fused or normed tensors included) stay quantized by default and
    stay close to the float model: int8 activations move these random logits by a few percent."""
    _model, path = write(tmp_path, case, QT.Q8_0)
    llm, reference = LLM(model=path, device="cpu"), float_llm(path)
    assert type(llm.model.layers[0].attn.k_proj).__name__ == "QuantLinear"
    got, expected = llm.logits(IDS), reference.logits(IDS)
    assert (got - expected).norm() < 0.1 * expected.norm()


def refusal(
    tmp_path: Path, case: str, edit_metadata: dict[str, Any], tensors: dict[str, Any] | None = None
) -> str:
    """The UnsupportedModelError message for `case`'s GGUF with its metadata (and tensors) edited."""
    from rebar.errors import UnsupportedModelError

    arch, overrides = CASES[case]
    model = hf_tiny.build_decoder(
        arch, seed=1, vocab_size=VOCAB, intermediate_size=128, **overrides
    )
    contents = gguf_convert.convert(model)
    contents.metadata.update(edit_metadata)
    contents.tensors.update(tensors or {})
    with pytest.raises(UnsupportedModelError) as info:
        open_checkpoint(contents.write(tmp_path / "edited.gguf"))
    return str(info.value)


def test_family_variants_rebar_lacks_are_refused_by_name(tmp_path: Path) -> None:
    """What would change every logit if ignored: softcapping, partial rotary embeddings, LongRoPE,
    a RoPE scaling kind rebar lacks."""
    import numpy as np
    from gguf_builder import Tensor

    assert "final_logit_softcapping" in refusal(
        tmp_path, "gemma3", {"gemma3.final_logit_softcapping": 30.0}
    )
    assert "partial rotary embeddings (16 of 32 dims)" in refusal(
        tmp_path, "qwen3", {"qwen3.rope.dimension_count": 16}
    )
    long_factors = {"rope_factors_long.weight": Tensor(np.ones(8, np.float32), QT.F32)}
    assert "LongRoPE" in refusal(tmp_path, "phi3", {}, long_factors)
    assert "'yarn'" in refusal(
        tmp_path, "qwen3", {"qwen3.rope.scaling.type": "yarn", "qwen3.rope.scaling.factor": 4.0}
    )
