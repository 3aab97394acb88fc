"""The bundled Gemma 3 270M through rebar's float32 reference path against transformers reading the
same GGUF tensors itself (its own dequantization, its own Gemma 3 code): the model's math,
independent of the kernels and of rebar's loader.

transformers reads a copy of the file without the tokenizer's arrays (the vocabulary's size as
`gemma3.vocab_size`): its GGUF parser spent ~35 s of the test's ~50 on the 262,144 tokens, scores
and types, which the model's math never reads. The copy's tensors are checked byte for byte against
the original file, where gguf's own reader places them, so a tensor rebar's reader misplaced or
mistyped could not reach both sides alike."""

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


def without_the_vocabulary(path: Path, out: Path) -> Path:
    """A copy of the GGUF at `path` with the same tensors and metadata but the tokenizer's arrays."""
    from gguf_builder import GGUFContents, Tensor

    from rebar.model.loader.gguf_reader import GGUFFile

    source = GGUFFile(path)
    arch = source.metadata["general.architecture"]
    metadata = {
        key: value
        for key, value in source.metadata.items()
        if key not in ("general.architecture", "general.alignment")
        and not (key.startswith("tokenizer.ggml.") and isinstance(value, list))
    }
    metadata[f"{arch}.vocab_size"] = len(source.metadata["tokenizer.ggml.tokens"])
    tensors = {
        name: Tensor(tensor.data(source.buffer), tensor.qtype)
        for name, tensor in source.tensors.items()
    }
    alignment = source.metadata.get("general.alignment")
    GGUFContents(arch, metadata, tensors, alignment).write(out)
    # Both files end with the same tensor data, written in the same order with the same alignment:
    # the copy's, from where gguf's reader finds it, must be the original's last bytes exactly.
    from gguf import GGUFReader

    data = out.read_bytes()[GGUFReader(out).data_offset :]
    assert path.read_bytes().endswith(data), "the copy's tensors differ from the original's"
    return out


@pytest.fixture(scope="module")
def hf_gemma3(gemma3_tokenizer, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from rebar.model.resolve import resolve_model_path

    copy = without_the_vocabulary(
        resolve_model_path("gemma3"), tmp_path_factory.mktemp("gemma3") / "gemma3.gguf"
    )
    return AutoModelForCausalLM.from_pretrained(
        str(copy.parent), gguf_file=copy.name, dtype=torch.float32
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
