"""The bundled Gemma 3 270M through rebar's float32 reference path against transformers reading the
same GGUF file itself (its own dequantization, its own Gemma 3 code): the model's math, independent
of the kernels and of rebar's loader."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from float_reference import float_llm
from suite_tiers import limit

pytestmark = limit("reference_model")  # tests/suite_tiers.py

FIXTURES = json.loads(
    (Path(__file__).parent.parent / "fixtures" / "gemma3_llamacpp_greedy.json").read_text("utf-8")
)


@pytest.fixture(scope="module")
def hf_gemma3(gemma3_tokenizer):
    from transformers import AutoModelForCausalLM

    from rebar.model.resolve import resolve_model_path

    path = resolve_model_path("gemma3")
    return AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()


def test_float_logits_match_transformers_on_the_real_weights(hf_gemma3) -> None:
    """Every position of every fixture prompt and its continuation (sliding and global layers, the
    scaled embedding, all four norms per layer): logits of magnitude ~100 agree to 5e-4."""
    reference = float_llm("gemma3")
    worst = 0.0
    for case in FIXTURES["cases"]:
        ids = case["prompt_ids"] + case["greedy_ids"]
        with torch.no_grad():
            expected = hf_gemma3(torch.tensor([ids])).logits[0].float()
        ours = reference.logits(ids)
        worst = max(worst, float((ours - expected).abs().max()))
        assert torch.equal(ours.argmax(-1), expected.argmax(-1))
    assert worst < 5e-4, worst
