"""rebar's quantized checkpoint: safetensors files plus a JSON manifest, loaded memory-mapped.

A checkpoint folder holds:

- `rebar-quant.json`, the manifest: format version, method, group size, the tool that wrote it, the
  source model (path, format, SHA-256), calibration settings, the ModelConfig, the safetensors
  files, and one entry per model tensor: `{"kind": "float", "dtype", "shape"}` or
  `{"kind": "int8" | "int4", "group_size", "shape"}` with `shape` the logical `[out, in]`.
- `model*.safetensors`: a float tensor under its rebar name; a quantized one as `NAME.qweight`
  (int8 `[out, in]` or uint8 `[out, in/2]`, see int_formats.py), `NAME.scales` and, for int4,
  `NAME.offsets` (both fp16 `[out, in/group_size]`).
- `tokenizer.json` and `tokenizer_config.json` (with the chat template), as in an HF folder.

Loading checks every tensor the manifest names against what the files hold (present, dtype, shape,
nothing extra) and raises ModelFormatError naming the tensor at fault, before any weight is read.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from rebar.errors import ModelFormatError
from rebar.model.config import ModelConfig, RopeScaling
from rebar.model.loader.base import Checkpoint, TensorInfo
from rebar.model.loader.mapped_files import MappedSafetensors
from rebar.model.tokenizer import Tokenizer, read_tokenizer_config
from rebar.weights.handler import QUANT_CHECKPOINT_FORMAT
from rebar.weights.int_formats import SCALE_DTYPE, QuantizedWeight

MANIFEST_NAME = "rebar-quant.json"
FORMAT_VERSION = 1
DEFAULT_MAX_SHARD_BYTES = 2 * 2**30

# safetensors dtype names <-> torch dtypes, for the types this format stores
_DTYPE_NAMES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int8: "I8",
    torch.uint8: "U8",
}
_DTYPES = {name: dtype for dtype, name in _DTYPE_NAMES.items()}


@dataclasses.dataclass(frozen=True)
class StoredPart:
    """One safetensors tensor the manifest requires: its name, dtype and shape."""

    name: str
    dtype: str  # safetensors name, e.g. "U8"
    shape: tuple[int, ...]


def is_quantized_checkpoint(path: Path) -> bool:
    return path.is_dir() and (path / MANIFEST_NAME).is_file()


def expected_parts(name: str, entry: dict[str, Any]) -> list[StoredPart]:
    """The safetensors tensors that must hold manifest entry `name`."""
    shape = tuple(entry["shape"])
    if entry["kind"] == "float":
        return [StoredPart(name, _DTYPE_NAMES[_float_dtype(entry["dtype"])], shape)]
    out_features, in_features = shape
    grouped = (out_features, in_features // entry["group_size"])
    scale = _DTYPE_NAMES[SCALE_DTYPE]
    if entry["kind"] == "int8":
        return [
            StoredPart(f"{name}.qweight", "I8", shape),
            StoredPart(f"{name}.scales", scale, grouped),
        ]
    return [
        StoredPart(f"{name}.qweight", "U8", (out_features, in_features // 2)),
        StoredPart(f"{name}.scales", scale, grouped),
        StoredPart(f"{name}.offsets", scale, grouped),
    ]


def _float_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if dtype not in _DTYPE_NAMES or dtype in (torch.int8, torch.uint8):
        raise ModelFormatError(f"{MANIFEST_NAME}: unsupported float dtype {name!r}")
    return dtype


# ----- writing --------------------------------------------------------------------------------


def manifest_entry(value: torch.Tensor | QuantizedWeight) -> dict[str, Any]:
    if isinstance(value, QuantizedWeight):
        return {
            "kind": f"int{value.bits}",
            "group_size": value.group_size,
            "shape": [value.out_features, value.in_features],
        }
    return {
        "kind": "float",
        "dtype": str(value.dtype).removeprefix("torch."),
        "shape": list(value.shape),
    }


def _stored_tensors(name: str, value: torch.Tensor | QuantizedWeight) -> dict[str, torch.Tensor]:
    if not isinstance(value, QuantizedWeight):
        return {name: value.contiguous()}
    parts = {f"{name}.qweight": value.qweight, f"{name}.scales": value.scales.to(SCALE_DTYPE)}
    if value.offsets is not None:
        parts[f"{name}.offsets"] = value.offsets.to(SCALE_DTYPE)
    return {key: tensor.contiguous() for key, tensor in parts.items()}


def write_checkpoint(
    folder: Path,
    tensors: dict[str, torch.Tensor | QuantizedWeight],
    config: ModelConfig,
    tokenizer: Tokenizer,
    chat_template: str | None,
    header: dict[str, Any],
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> Path:
    """Write `tensors` (rebar names) into `folder` with a manifest; `header` holds method, group
    size, source and calibration details. Files are sharded at about `max_shard_bytes`."""
    folder.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    shard_bytes = 0
    for name, value in tensors.items():
        parts = _stored_tensors(name, value)
        size = sum(t.numel() * t.element_size() for t in parts.values())
        if shards[-1] and shard_bytes + size > max_shard_bytes:
            shards.append({})
            shard_bytes = 0
        shards[-1].update(parts)
        shard_bytes += size
    files = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    for file, shard in zip(files, shards):
        save_file(shard, str(folder / file), metadata={"format": "pt"})
    tokenizer.save_hf_files(folder, chat_template)
    manifest = {
        "format": QUANT_CHECKPOINT_FORMAT,
        "format_version": FORMAT_VERSION,
        **header,
        "config": dataclasses.asdict(config),
        "eos_token_ids": list(tokenizer.special.eos_token_ids),
        "files": files,
        "tensors": {name: manifest_entry(value) for name, value in tensors.items()},
    }
    (folder / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2), encoding="utf-8")
    return folder


# ----- reading --------------------------------------------------------------------------------


def read_manifest(folder: Path) -> dict[str, Any]:
    path = folder / MANIFEST_NAME
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelFormatError(f"{path} is not a readable JSON manifest: {exc}") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != QUANT_CHECKPOINT_FORMAT:
        raise ModelFormatError(f"{path} is not a {QUANT_CHECKPOINT_FORMAT} manifest")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ModelFormatError(
            f"{path}: format_version {manifest.get('format_version')!r} "
            f"is not supported (rebar reads {FORMAT_VERSION})"
        )
    for key in ("method", "config", "files", "tensors", "source", "tool"):
        if key not in manifest:
            raise ModelFormatError(f"{path} is missing the key {key!r}")
    return manifest


def _config(raw: dict[str, Any], folder: Path) -> ModelConfig:
    if not isinstance(raw, dict) or not isinstance(raw.get("rope_scaling") or {}, dict):
        raise ModelFormatError(
            f"{folder / MANIFEST_NAME}: 'config' (and its rope_scaling) must be JSON objects"
        )
    try:
        scaling = raw.get("rope_scaling")
        return ModelConfig(**{**raw, "rope_scaling": RopeScaling(**scaling) if scaling else None})
    except (TypeError, ValueError) as exc:
        raise ModelFormatError(f"{folder / MANIFEST_NAME}: invalid model config: {exc}") from exc


def _index_files(folder: Path, files: list[str]) -> dict[str, tuple[Path, str, tuple[int, ...]]]:
    """Every tensor in the checkpoint's files: name -> (file, safetensors dtype, shape)."""
    index: dict[str, tuple[Path, str, tuple[int, ...]]] = {}
    for file_name in files:
        path = folder / file_name
        if not path.is_file():
            raise ModelFormatError(f"{folder}: the manifest names {file_name}, which is missing")
        try:
            with safe_open(path, framework="pt") as handle:
                for key in handle.keys():  # noqa: SIM118 - safe_open is not iterable
                    view = handle.get_slice(key)
                    index[key] = (path, view.get_dtype(), tuple(int(d) for d in view.get_shape()))
        except SafetensorError as exc:
            raise ModelFormatError(
                f"{path} is not a readable safetensors file (truncated or corrupt?): {exc}"
            ) from exc
    return index


def _check_entry(name: str, entry: Any) -> None:
    if (
        not isinstance(entry, dict)
        or entry.get("kind") not in ("float", "int8", "int4")
        or not isinstance(entry.get("shape"), list)
    ):
        raise ModelFormatError(
            f"{MANIFEST_NAME}: entry for tensor {name!r} is malformed: {entry!r}"
        )
    if entry["kind"] == "float":
        return
    group_size = entry.get("group_size")
    if (
        len(entry["shape"]) != 2
        or not isinstance(group_size, int)
        or group_size <= 0
        or entry["shape"][1] % group_size
    ):
        raise ModelFormatError(
            f"{MANIFEST_NAME}: tensor {name!r} has group size "
            f"{group_size!r}, which does not tile its shape {entry['shape']}"
        )
    if entry["kind"] == "int4" and group_size % 2:
        raise ModelFormatError(
            f"{MANIFEST_NAME}: int4 tensor {name!r} has an odd group size {group_size}"
        )


def validate_tensors(
    folder: Path, manifest: dict[str, Any], index: dict[str, tuple[Path, str, tuple[int, ...]]]
) -> None:
    """Raise ModelFormatError naming the first tensor that disagrees with the manifest."""
    required: set[str] = set()
    for name, entry in manifest["tensors"].items():
        _check_entry(name, entry)
        description = (
            entry["kind"]
            if entry["kind"] == "float"
            else f"{entry['kind']} with group size {entry['group_size']}"
        )
        for part in expected_parts(name, entry):
            required.add(part.name)
            if part.name not in index:
                raise ModelFormatError(
                    f"{folder}: tensor {part.name!r} is missing "
                    f"(the manifest says {name!r} is {description})"
                )
            _, dtype, shape = index[part.name]
            if (dtype, shape) != (part.dtype, part.shape):
                raise ModelFormatError(
                    f"{folder}: tensor {part.name!r} is {dtype} {list(shape)}, but the manifest "
                    f"says {name!r} is {description}, which needs {part.dtype} {list(part.shape)}"
                )
    extra = sorted(set(index) - required)
    if extra:
        raise ModelFormatError(f"{folder}: tensor {extra[0]!r} is not in the manifest")


def load_quantized_checkpoint(folder: Path) -> Checkpoint:
    """Open a checkpoint written by `write_checkpoint`; weights stay memory-mapped until used."""
    manifest = read_manifest(folder)
    config = _config(manifest["config"], folder)
    index = _index_files(folder, manifest["files"])
    validate_tensors(folder, manifest, index)
    entries: dict[str, dict[str, Any]] = manifest["tensors"]

    files = MappedSafetensors()

    def read(part: str) -> torch.Tensor:
        return files.get_tensor(index[part][0], part)  # memory-mapped, read lazily

    def load_quantized(name: str) -> QuantizedWeight | None:
        entry = entries[name]
        if entry["kind"] == "float":
            return None
        offsets = read(f"{name}.offsets") if entry["kind"] == "int4" else None
        return QuantizedWeight(
            int(entry["kind"][3:]),
            entry["group_size"],
            read(f"{name}.qweight"),
            read(f"{name}.scales"),
            offsets,
        )

    def load(name: str, dtype: torch.dtype) -> torch.Tensor:
        weight = load_quantized(name)
        return read(name).to(dtype) if weight is None else weight.dequantize(dtype)

    infos = {}
    for name, entry in entries.items():
        parts = expected_parts(name, entry)
        num_bytes = sum(_numel(p.shape) * _DTYPES[p.dtype].itemsize for p in parts)
        storage = entry["dtype"] if entry["kind"] == "float" else _describe(entry)
        infos[name] = TensorInfo(name, parts[0].name, tuple(entry["shape"]), storage, num_bytes)

    tokenizer = Tokenizer.from_hf_folder(folder, eos_token_ids=manifest.get("eos_token_ids", []))
    template = read_tokenizer_config(folder).get("chat_template")
    return Checkpoint(
        path=folder,
        format=QUANT_CHECKPOINT_FORMAT,
        config=config,
        tokenizer=tokenizer,
        chat_template=template if isinstance(template, str) else None,
        tensors=infos,
        _load=load,
        _load_quantized=load_quantized,
        metadata=_summary(manifest),
    )


def _describe(entry: dict[str, Any]) -> str:
    per_channel = entry["group_size"] == entry["shape"][1]
    return f"{entry['kind']} {'per-channel' if per_channel else 'g' + str(entry['group_size'])}"


def _summary(manifest: dict[str, Any]) -> dict[str, str]:
    """What `rebar inspect` shows about how the checkpoint was made."""
    summary = {
        "quant.method": str(manifest["method"]),
        "quant.group_size": str(manifest.get("group_size")),
        "quant.tool": str(manifest["tool"]),
    }
    for key, value in manifest["source"].items():
        summary[f"quant.source.{key}"] = str(value)
    for key, value in (manifest.get("calibration") or {}).items():
        summary[f"quant.calibration.{key}"] = str(value)
    summary["quant.files"] = ", ".join(manifest["files"])
    return summary


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count
