"""GGUF Q4_0 / Q4_1 weights stay quantized where a packed kernel exists; Q8_0 (no grouped int8 kernel) stays float."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as QT
from tiny_quant import IDS, tiny_gguf

from rebar import LLM
from rebar.model.loader import open_checkpoint
from rebar.quant.qlinear import QuantLinear

LINEARS = ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


@pytest.mark.parametrize("storage", [QT.Q4_0, QT.Q4_1], ids=lambda q: q.name)
def test_q4_weights_are_kept_quantized_and_exact(tmp_path: Path, storage: QT) -> None:
    path, _, _ = tiny_gguf(tmp_path, storage=storage)
    llm = LLM(model=path, device="cpu")
    checkpoint = open_checkpoint(path)
    for layer in range(2):
        for linear in LINEARS:
            module = llm.model.get_submodule(f"layers.{layer}.{linear}")
            assert isinstance(module, QuantLinear) and module.weight_q.describe() == "int4 g32"
            # the codes decode to exactly what the float loader produces (Q/K row order included)
            expected = checkpoint.load_tensor(f"layers.{layer}.{linear}.weight", torch.float32)
            assert torch.equal(module.weight_q.dequantize(), expected)
    # 268-token vocabulary: not a multiple of 16, so the int4 kernel cannot take the head, which stays float
    assert type(llm.model.lm_head) is torch.nn.Linear

    reference = LLM(model=path, device="cpu", dequantize=True)
    assert type(reference.model.layers[0].attn.q_proj) is torch.nn.Linear
    torch.testing.assert_close(llm.logits(IDS), reference.logits(IDS), atol=1e-4, rtol=0)  # dequantize path
    short, short_reference = llm.logits(IDS[:6]), reference.logits(IDS[:6])  # packed bf16 kernel path
    assert (short - short_reference).abs().max() < 0.06 * short_reference.abs().max()


def test_q8_0_stays_float(tmp_path: Path) -> None:
    path, _, _ = tiny_gguf(tmp_path, storage=QT.Q8_0)
    llm = LLM(model=path, device="cpu")
    assert not any(isinstance(m, QuantLinear) for m in llm.model.modules())
    assert open_checkpoint(path).load_quantized("layers.0.attn.q_proj.weight").describe() == "int8 g32"
