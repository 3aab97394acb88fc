"""`rebar quantize`: a float (or dequantized GGUF) decoder -> rebar's quantized checkpoint.

Decoder-layer linears get the chosen method (int8 per-channel or grouped symmetric; int4 grouped
asymmetric, round-to-nearest or activation-aware). The token embedding, and the output head when
it is not tied to it, are stored int8 per row with every method: they are read a row at a time or
feed the logits directly, and int8 keeps them close to the reference for a quarter of the bytes.
Norms, biases and RoPE factors stay float32.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm import tqdm  # type: ignore[import-untyped]

import rebar
from rebar.errors import InvalidRequestError
from rebar.model.build import build_model
from rebar.model.llama import LlamaModel
from rebar.model.loader import Checkpoint, open_checkpoint
from rebar.model.loader.rebar_quant import write_checkpoint
from rebar.model.tokenizer import Tokenizer
from rebar.quant.awq import AwqResult, Grid, apply_awq, linear_weight
from rebar.quant.calib_data import JsonlDataset
from rebar.weights.int_formats import (
    QuantizedWeight,
    check_group_size,
    quantize_int4,
    quantize_int4_on_grid,
    quantize_int8,
)

logger = logging.getLogger("rebar.quant")

METHODS = ("int8", "int4-rtn", "int4-awq")
DEFAULT_INT4_GROUP_SIZE = (
    64  # divides the widths of common small models (576, 1536) where 128 does not
)
_INT8_EVERYWHERE = ("embed_tokens.weight", "lm_head.weight")


@dataclass(frozen=True)
class QuantizeSpec:
    """What to make. `group_size` None means per output channel for int8 and 64 for int4.

    Calibration settings apply to int4-awq only, which requires `calib_path`.
    """

    method: str
    group_size: int | None = None
    calib_path: Path | None = None
    calib_sequences: int = 32
    calib_seq_len: int = 512
    text_field: str = "text"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise InvalidRequestError(
                f"method must be one of {', '.join(METHODS)}, got {self.method!r}", "method"
            )
        if self.group_size is not None and (
            self.group_size <= 0 or (self.bits == 4 and self.group_size % 2)
        ):
            raise InvalidRequestError(
                f"group size must be a positive (for int4, even) number, got {self.group_size}",
                "group_size",
            )
        if self.method == "int4-awq" and self.calib_path is None:
            raise InvalidRequestError(
                "int4-awq needs calibration text: pass --calib "
                "FILE.jsonl (e.g. data/corpus/calib.jsonl)",
                "calib",
            )
        if self.method != "int4-awq" and self.calib_path is not None:
            raise InvalidRequestError(
                f"--calib only applies to int4-awq; {self.method} uses no calibration data", "calib"
            )
        if self.calib_sequences < 1 or self.calib_seq_len < 2:
            raise InvalidRequestError(
                "calibration needs at least 1 sequence of at least 2 tokens", "calib"
            )

    @property
    def bits(self) -> int:
        return 8 if self.method == "int8" else 4

    @property
    def int4_group_size(self) -> int:
        """The group size of an int4 method: always one (64 unless given)."""
        assert self.bits == 4
        return self.group_size or DEFAULT_INT4_GROUP_SIZE

    @property
    def effective_group_size(self) -> int | None:
        if self.bits == 4:
            return self.group_size or DEFAULT_INT4_GROUP_SIZE
        return self.group_size


def source_digest(path: Path) -> str:
    """SHA-256 of a model file, or of a folder's files (names and contents, in name order)."""
    digest = hashlib.sha256()
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    for file in files:
        if path.is_dir():
            digest.update(str(file.relative_to(path)).encode() + b"\0")
        with open(file, "rb") as handle:
            while block := handle.read(2**20):
                digest.update(block)
    return digest.hexdigest()


def calibration_sequences(
    dataset: JsonlDataset, tokenizer: Tokenizer, num_sequences: int, seq_len: int, seed: int
) -> list[list[int]]:
    """`num_sequences` windows of `seq_len` tokens cut from seeded-random records joined end to
    end."""
    buffer: list[int] = []
    sequences: list[list[int]] = []
    for text in dataset.shuffled_texts(seed):
        buffer.extend(tokenizer.encode(text + "\n\n"))
        while len(buffer) >= seq_len and len(sequences) < num_sequences:
            sequences.append(buffer[:seq_len])
            buffer = buffer[seq_len:]
        if len(sequences) == num_sequences:
            return sequences
    raise InvalidRequestError(
        f"{dataset.path} holds too little usable text for {num_sequences} sequences of "
        f"{seq_len} tokens (got {len(sequences)}); lower --calib-samples or --calib-seq-len",
        "calib",
    )


def _linear_weight_names(model: nn.Module) -> list[str]:
    return [
        f"{path}.weight"
        for path, module in model.named_modules()
        if isinstance(module, nn.Linear) and path.startswith("layers.")
    ]


def _check_group_size(model: nn.Module, spec: QuantizeSpec) -> None:
    group_size = spec.effective_group_size
    if group_size is None:
        return
    for name in _linear_weight_names(model):
        weight = linear_weight(model, name.removesuffix(".weight"))
        try:
            check_group_size(weight.shape[1], group_size, spec.bits, name.removesuffix(".weight"))
        except ValueError as exc:
            raise InvalidRequestError(
                f"{exc}; choose a group size that divides it (32 or 64 for most small models)",
                "group_size",
            ) from exc


def _quantize_tensors(
    model: nn.Module,
    spec: QuantizeSpec,
    grids: dict[str, Grid],
    bar: Callable[[str, int], Callable[[], None]],
) -> dict[str, torch.Tensor | QuantizedWeight]:
    linears = set(_linear_weight_names(model))
    state = model.state_dict()
    tick = bar("quantizing", len(state))
    tensors: dict[str, torch.Tensor | QuantizedWeight] = {}
    for name, value in state.items():
        if name in _INT8_EVERYWHERE:
            tensors[name] = quantize_int8(value)
        elif name in linears and spec.bits == 8:
            tensors[name] = quantize_int8(value, spec.effective_group_size)
        elif name in grids:
            tensors[name] = quantize_int4_on_grid(
                value, spec.int4_group_size, grids[name].scales, grids[name].offsets
            )
        elif name in linears:
            tensors[name] = quantize_int4(value, spec.int4_group_size)
        else:
            tensors[name] = value.float()
        tick()
    return tensors


def _progress_bar(enabled: bool) -> Callable[[str, int], Callable[[], None]]:
    def start(label: str, total: int) -> Callable[[], None]:
        bar = tqdm(total=total, desc=label, unit="step", disable=not enabled, leave=True)

        def tick() -> None:
            bar.update(1)
            if bar.n >= total:
                bar.close()

        return tick

    return start


@dataclass(frozen=True)
class QuantizeResult:
    folder: Path
    seconds: float
    awq: AwqResult | None


def quantize(
    model: str | Path, spec: QuantizeSpec, out: Path, progress: bool = True
) -> QuantizeResult:
    """Quantize `model` (alias, GGUF file, HF folder) as `spec` says and write the checkpoint to
    `out`."""
    started = time.perf_counter()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise InvalidRequestError(f"output folder {out} already exists and is not empty", "out")
    checkpoint = open_checkpoint(model)
    if not checkpoint.config.is_decoder:
        raise InvalidRequestError(
            f"{checkpoint.config.source_architecture} is "
            "an embedding model; rebar quantizes decoders",
            "model",
        )
    float_model = build_model(checkpoint, torch.float32, "cpu", dequantize=True)
    assert isinstance(float_model, LlamaModel)
    _check_group_size(float_model, spec)
    bar = _progress_bar(progress)

    awq_result = None
    calibration: dict[str, Any] | None = None
    if spec.method == "int4-awq":
        assert spec.calib_path is not None
        with JsonlDataset(spec.calib_path, spec.text_field) as dataset:
            sequences = calibration_sequences(
                dataset, checkpoint.tokenizer, spec.calib_sequences, spec.calib_seq_len, spec.seed
            )
            calibration = {
                "file": str(spec.calib_path),
                "sha256": source_digest(spec.calib_path),
                "text_field": spec.text_field,
                "sequences": spec.calib_sequences,
                "seq_len": spec.calib_seq_len,
                "seed": spec.seed,
                "bad_lines_skipped": len(dataset.bad_lines),
                "rounding": "error feedback",
            }
        awq_result = apply_awq(float_model, sequences, spec.int4_group_size, progress=bar)

    tensors = _quantize_tensors(float_model, spec, awq_result.grids if awq_result else {}, bar)
    if "rope_freq_factors" in checkpoint.tensors:
        tensors["rope_freq_factors"] = checkpoint.load_tensor("rope_freq_factors", torch.float32)
    header = {
        "method": spec.method,
        "bits": spec.bits,
        "group_size": spec.effective_group_size,
        "tool": f"rebar {rebar.__version__}",
        "source": _source(checkpoint, model),
        "calibration": calibration,
    }
    write_checkpoint(
        out, tensors, checkpoint.config, checkpoint.tokenizer, checkpoint.chat_template, header
    )
    seconds = time.perf_counter() - started
    logger.info("wrote %s (%s) in %.1fs", out, spec.method, seconds)
    return QuantizeResult(out, seconds, awq_result)


def _source(checkpoint: Checkpoint, model: str | Path) -> dict[str, str]:
    return {
        "model": str(model),
        "path": str(checkpoint.path),
        "format": checkpoint.format,
        "sha256": source_digest(checkpoint.path),
    }
