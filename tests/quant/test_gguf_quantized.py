"""GGUF Q4_0 / Q4_1 / Q8_0 weights stay quantized where a small-batch kernel exists for them: rebar's AVX2
kernels take every shape (grouped int8 included); torch's packed kernels need int4 with 16-row multiples."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as QT
from tiny_quant import IDS, tiny_gguf, use_reference_kernels

from rebar import LLM
from rebar.model.loader import open_checkpoint
from rebar.kernels import cpu_quant
from rebar.quant.qlinear import QuantLinear

NATIVE = cpu_quant.available()

LINEARS = ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


@pytest.mark.parametrize("storage", [QT.Q4_0, QT.Q4_1], ids=lambda q: q.name)
def test_q4_weights_are_kept_quantized_and_exact(tmp_path: Path, storage: QT) -> None:
    path, _, _ = tiny_gguf(tmp_path, storage=storage)
    llm = LLM(model=path, device="cpu", quantized_gguf=True)
    checkpoint = open_checkpoint(path)
    for layer in range(2):
        for linear in LINEARS:
            module = llm.model.get_submodule(f"layers.{layer}.{linear}")
            assert isinstance(module, QuantLinear) and module.weight_q.describe() == "int4 g32"
            # the codes decode to exactly what the float loader produces (Q/K row order included)
            expected = checkpoint.load_tensor(f"layers.{layer}.{linear}.weight", torch.float32)
            assert torch.equal(module.weight_q.dequantize(), expected)
    # 268-token vocabulary: not a multiple of 16, so only rebar's kernel takes the head; else it stays float
    assert type(llm.model.lm_head) is (QuantLinear if NATIVE else torch.nn.Linear)

    reference = LLM(model=path, device="cpu", dequantize=True)
    assert type(reference.model.layers[0].attn.q_proj) is torch.nn.Linear
    for ids in (IDS[:6], IDS):  # the kernels' paths
        got, expected = llm.logits(ids), reference.logits(ids)
        # activations rounded to int8 (rebar's kernel) or bf16 (torch's): this random model's nearly
        # flat logits move by ~8% (relative norm; a wrong kernel moves them by ~100%) and near-ties
        # flip, but predictions stay among the reference's top three
        assert (got - expected).norm() < 0.12 * expected.norm()
        top3 = expected.topk(3, dim=-1).indices
        assert sum(int(p) in top3[i].tolist() for i, p in enumerate(got.argmax(-1))) >= 0.9 * len(ids)
    use_reference_kernels(llm.model)  # the float arithmetic: the codes are exactly the float weights
    torch.testing.assert_close(llm.logits(IDS), reference.logits(IDS), atol=1e-4, rtol=0)


def test_q8_0_stays_quantized_only_with_rebars_kernel(tmp_path: Path) -> None:
    path, _, _ = tiny_gguf(tmp_path, storage=QT.Q8_0)
    llm = LLM(model=path, device="cpu", quantized_gguf=True)
    quantized = [m for m in llm.model.modules() if isinstance(m, QuantLinear)]
    if NATIVE:  # grouped int8: rebar's kernel takes it
        assert len(quantized) >= 14 and all(m.kernel_for(1).name == "avx2-int8" for m in quantized)
    else:  # torch has no grouped int8 kernel
        assert not quantized
    assert open_checkpoint(path).load_quantized("layers.0.attn.q_proj.weight").describe() == "int8 g32"


def test_gguf_weights_are_float_unless_asked(tmp_path: Path) -> None:
    path, _, _ = tiny_gguf(tmp_path, storage=QT.Q4_1)
    llm = LLM(model=path, device="cpu")
    assert not any(isinstance(m, QuantLinear) for m in llm.model.modules())
