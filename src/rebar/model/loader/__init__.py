"""Open a checkpoint by alias or path: GGUF files, Hugging Face safetensors folders and rebar's
quantized checkpoints (folders with a `rebar-quant.json` manifest)."""

from __future__ import annotations

from pathlib import Path

from rebar.model.loader.base import Checkpoint, TensorInfo
from rebar.model.loader.gguf_file import load_gguf
from rebar.model.loader.hf_folder import load_hf_folder
from rebar.model.loader.rebar_quant import is_quantized_checkpoint, load_quantized_checkpoint
from rebar.model.resolve import resolve_model_path


def open_checkpoint(model: str | Path) -> Checkpoint:
    """Read metadata, tokenizer and the tensor index; weights stay on disk until loaded."""
    path = resolve_model_path(model)
    if is_quantized_checkpoint(path):
        return load_quantized_checkpoint(path)
    if path.is_dir():
        return load_hf_folder(path)
    return load_gguf(path)


__all__ = ["Checkpoint", "TensorInfo", "open_checkpoint"]
