"""Tiny models for quantization tests: a GGUF file from seeded weights, and what quantizing it
should give."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as QT
from gguf_builder import TinyConfig, model_contents, random_hf_state

from rebar.weights.int_formats import quantize_int4, quantize_int8
from rebar.weights.qlinear import DequantizedMatmul, KernelChoice, QuantLinear

IDS = [(i * 37 + 11) % 260 for i in range(40)]  # 40 tokens: past the int8 kernel's row limit
LINEAR_SUFFIXES = ("_proj.weight",)
INT8_EVERYWHERE = ("model.embed_tokens.weight", "lm_head.weight")

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
)


def use_reference_kernels(model: torch.nn.Module) -> torch.nn.Module:
    """Pin every QuantLinear of `model` to dequantize-then-matmul, the float reference arithmetic:
    for tests of what a checkpoint holds (the kernels' own accuracy is tested against it
    elsewhere)."""
    for module in model.modules():
        if isinstance(module, QuantLinear):
            module.kernels = (KernelChoice(math.inf, DequantizedMatmul(module.weight_q)),)
    return model


def tiny_gguf(
    folder: Path, tied: bool = False, storage: QT = QT.F32, seed: int = 5
) -> tuple[Path, TinyConfig, dict[str, np.ndarray]]:
    cfg = TinyConfig(arch="llama", tied=tied)
    state = random_hf_state(cfg, seed=seed)
    contents = model_contents(cfg, state, storage)
    contents.metadata["tokenizer.chat_template"] = TEMPLATE
    return (
        contents.write(folder / f"tiny-{storage.name}-{'tied' if tied else 'untied'}.gguf"),
        cfg,
        state,
    )


def quantized_state(
    state: dict[str, np.ndarray], method: str, group_size: int | None
) -> dict[str, np.ndarray]:
    """The HF-named weights a checkpoint made with `method` holds, dequantized: the reference model."""
    out = {}
    for name, values in state.items():
        w = torch.from_numpy(values)
        if name in INT8_EVERYWHERE:
            w = quantize_int8(w).dequantize()
        elif name.endswith(LINEAR_SUFFIXES) and method == "int8":
            w = quantize_int8(w, group_size).dequantize()
        elif name.endswith(LINEAR_SUFFIXES):
            w = quantize_int4(w, group_size).dequantize()
        out[name] = w.numpy()
    return out


def hf_logits(cfg: TinyConfig, state: dict[str, np.ndarray], ids: list[int]) -> torch.Tensor:
    """Logits of transformers' Llama with `state` as its weights (tied heads share the embedding)."""
    import transformers

    model = transformers.LlamaForCausalLM(cfg.hf_config()).eval()
    model.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()}, strict=not cfg.tied)
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()
