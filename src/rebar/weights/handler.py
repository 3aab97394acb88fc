"""The quantization handler: swap a plain model's Linear / Embedding modules for quantized ones.

The model code never knows about quantization. `build_model` constructs it as usual, loads every
float tensor, and hands the quantized weights to `swap_in_quantized`, which replaces the module
owning each weight. LlamaModel ties its output head to `embed_tokens` by leaving `lm_head` None;
a quantized tied embedding therefore also becomes the model's `lm_head` (sharing the same codes).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from rebar.errors import ModelFormatError
from rebar.weights.qlinear import AnyQuantWeight, QuantEmbedding, QuantLinear, has_packed_kernel

TIED_EMBEDDING = "embed_tokens"
QUANT_CHECKPOINT_FORMAT = "rebar-quant"  # Checkpoint.format of rebar's own quantized checkpoints


def keep_quantized(weight: AnyQuantWeight, device: torch.device, checkpoint_format: str) -> bool:
    """Whether to run `weight` quantized: always for rebar's own quantized checkpoints, and for
    weights that arrive quantized (GGUF) wherever a small-batch kernel exists for `device` (rebar's
    CPU kernels take every GGUF block type rebar reads), as llama.cpp runs them: activations rounded
    to int8 per block of 32. Elsewhere (a GPU) they are expanded to the model's dtype.
    """
    if checkpoint_format == QUANT_CHECKPOINT_FORMAT:
        return True
    return has_packed_kernel(weight, device)


def swap_in_quantized(
    model: nn.Module, weights: Mapping[str, AnyQuantWeight], dtype: torch.dtype
) -> None:
    """Replace the owner of every `<module>.weight` in `weights` with its quantized counterpart.

    Biases stay the float tensors already loaded into the replaced module. Raises ModelFormatError
    naming the tensor when its module is not a Linear/Embedding or the shapes disagree.
    """
    for name, weight in weights.items():
        module_path = name.removesuffix(".weight")
        module = model.get_submodule(module_path)
        expected = _weight_shape(module, name)
        found = (weight.out_features, weight.in_features)
        if found != expected:
            raise ModelFormatError(
                f"quantized tensor {name!r} has shape {list(found)}, expected {list(expected)}"
            )
        if isinstance(module, nn.Embedding):
            replacement: nn.Module = QuantEmbedding(weight, dtype)
            if module_path == TIED_EMBEDDING and getattr(model, "lm_head", False) is None:
                model.lm_head = QuantLinear(weight)
        else:
            assert isinstance(module, nn.Linear)  # _weight_shape took nothing else
            replacement = QuantLinear(weight, module.bias)
        parent_path, _, attribute = module_path.rpartition(".")
        setattr(model.get_submodule(parent_path) if parent_path else model, attribute, replacement)


def _weight_shape(module: nn.Module, name: str) -> tuple[int, int]:
    if isinstance(module, nn.Linear):
        return module.out_features, module.in_features
    if isinstance(module, nn.Embedding):
        return module.num_embeddings, module.embedding_dim
    raise ModelFormatError(
        f"tensor {name!r} is stored quantized but belongs to a {type(module).__name__}"
    )
