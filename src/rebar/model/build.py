"""Checkpoint -> ready-to-run module: construct on the meta device, then load each tensor once."""

from __future__ import annotations

import torch
from torch import nn

from rebar import heap
from rebar.errors import ModelFormatError
from rebar.kernels.backends import default_attention_backend
from rebar.model.bert import BertModel
from rebar.model.llama import LlamaModel
from rebar.model.loader.base import Checkpoint
from rebar.weights.handler import keep_quantized, swap_in_quantized
from rebar.weights.qlinear import AnyQuantWeight

_NON_PARAMETER_TENSORS = ("rope_freq_factors",)


def build_model(
    checkpoint: Checkpoint,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    attention_backend: str | None = None,
    dequantize: bool = False,
) -> nn.Module:
    """Materialise the checkpoint's weights into a model in `dtype` on `device`, in eval mode.

    Weights the checkpoint holds as integer codes stay quantized (QuantLinear / QuantEmbedding,
    swapped in by `rebar.weights.handler`): always for rebar's quantized checkpoints, and for GGUF
    tensors where a packed kernel exists for `device` (every GGUF block type rebar reads, on the
    CPU). Each is repacked for the kernels and its file pages released as it goes, so loading never
    holds the file and its repacked copy in memory at once. `dequantize=True` expands everything to
    `dtype` instead (the float reference).

    Decoders run attention through the backend named `attention_backend` (None: the default for
    `device`); encoders ignore it. Raises ModelFormatError naming the tensor when one is missing,
    unexpected or mis-shaped, and InvalidRequestError for an unknown attention backend.
    """
    model = _empty_model(checkpoint, device, attention_backend)
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    _check_tensors(checkpoint, expected)
    device = torch.device(device)
    quantized = {} if dequantize else _quantized_weights(checkpoint, expected, device)
    state = {
        name: checkpoint.load_tensor(name, dtype).to(device)
        for name in expected
        if name not in quantized
    }
    missing, _ = model.load_state_dict(state, strict=False, assign=True)
    assert set(missing) == set(quantized), (
        f"unloaded tensors {sorted(set(missing) - set(quantized))[:5]}"
    )
    for name, weight in quantized.items():
        swap_in_quantized(model, {name: weight}, dtype)
        checkpoint.release(name)
        heap.trim()  # the repacking's temporaries, so they never pile up beside the packed weights
    # Buffers computed at construction (RoPE frequencies) are real CPU tensors; move them too.
    return model.to(device).eval().requires_grad_(False)


def _empty_model(
    checkpoint: Checkpoint, device: torch.device | str, attention_backend: str | None
) -> nn.Module:
    """The checkpoint's model with its parameters on the meta device (no memory yet)."""
    config = checkpoint.config
    if config.architecture == "bert":
        with torch.device("meta"):
            return BertModel(config)
    backend = attention_backend
    if backend is None:
        backend = default_attention_backend(torch.device(device))
    freq_factors = _rope_freq_factors(checkpoint)
    with torch.device("meta"):
        return LlamaModel(config, rope_freq_factors=freq_factors, attention_backend=backend)


def _check_tensors(checkpoint: Checkpoint, expected: dict[str, tuple[int, ...]]) -> None:
    """The checkpoint holds exactly the model's tensors, each of the model's shape."""
    present = {name for name in checkpoint.tensors if name not in _NON_PARAMETER_TENSORS}
    missing = sorted(set(expected) - present)
    if missing:
        raise ModelFormatError(
            f"{checkpoint.path}: missing tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}"
        )
    unexpected = sorted(present - set(expected))
    if unexpected:
        raise ModelFormatError(f"{checkpoint.path}: unexpected tensors {unexpected[:5]}")
    for name, shape in expected.items():
        found = checkpoint.tensors[name].shape
        if found != shape:
            raise ModelFormatError(
                f"{checkpoint.path}: tensor {checkpoint.tensors[name].file_name!r} "
                f"has shape {list(found)}, expected {list(shape)} from the model config"
            )


def _rope_freq_factors(checkpoint: Checkpoint) -> torch.Tensor | None:
    """The file's per-frequency RoPE divisors (GGUF `rope_freqs`), one positive factor per rotated
    pair."""
    if "rope_freq_factors" not in checkpoint.tensors:
        return None
    info = checkpoint.tensors["rope_freq_factors"]
    expected = (checkpoint.config.head_dim // 2,)
    if info.shape != expected:
        raise ModelFormatError(
            f"{checkpoint.path}: tensor {info.file_name!r} has shape {list(info.shape)}, "
            f"expected {list(expected)} from the model config"
        )
    factors = checkpoint.load_tensor("rope_freq_factors", torch.float32)
    if not bool(torch.isfinite(factors).all()) or not bool((factors > 0).all()):
        raise ModelFormatError(
            f"{checkpoint.path}: tensor {info.file_name!r} holds factors that are not finite "
            "and positive"
        )
    return factors


def _quantized_weights(
    checkpoint: Checkpoint, names: dict[str, tuple[int, ...]], device: torch.device
) -> dict[str, AnyQuantWeight]:
    kept = {}
    for name, shape in names.items():
        if len(shape) != 2:
            continue
        weight = checkpoint.load_quantized(name)
        if weight is not None and keep_quantized(weight, device, checkpoint.format):
            kept[name] = weight.to(device)
    return kept
