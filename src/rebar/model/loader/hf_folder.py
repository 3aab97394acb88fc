"""Hugging Face folders: `config.json` + `*.safetensors` (single file or sharded with an index).

Tensors are read through `safetensors.safe_open`, which memory-maps the files; no pickle is ever
loaded. Decoder checkpoints (the Llama family: hf_decoders.py) are renamed to rebar's tensor names,
fused tensors split; BERT checkpoints keep HF's names, which `rebar.model.bert` mirrors.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from rebar.errors import ModelFormatError, UnsupportedModelError
from rebar.model.config import ModelConfig
from rebar.model.loader.base import Checkpoint, TensorInfo
from rebar.model.loader.hf_decoders import DECODER_ARCHITECTURES, Part, decoder_config, tensor_parts
from rebar.model.loader.mapped_files import MappedSafetensors
from rebar.model.tokenizer import Tokenizer, read_tokenizer_config

ENCODER_ARCHITECTURES = ("BertModel",)
# Buffers some exporters save that carry no weights.
_IGNORED = re.compile(r".*(rotary_emb\.inv_freq|position_ids)$|^pooler\..*")


def _encoder_name(file_name: str) -> str | None:
    name = file_name.removeprefix("bert.")
    return name if name.startswith(("embeddings.", "encoder.")) else None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ModelFormatError(f"{path} is not valid JSON: {exc}") from exc


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(_read_json(index).get("weight_map", {}).values()))
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            raise ModelFormatError(f"{index.name} names shards that are missing: {missing}")
        return [folder / s for s in shards]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelFormatError(f"{folder} has no *.safetensors weights (pickled .bin files are never loaded)")
    return files


def encoder_config(config: dict[str, Any], folder: Path) -> ModelConfig:
    act = config.get("hidden_act", "gelu")
    if act != "gelu":
        raise UnsupportedModelError(f"BERT activation {act!r} is not supported (expected gelu)")
    if config.get("position_embedding_type", "absolute") != "absolute":
        raise UnsupportedModelError("only absolute position embeddings are supported for BERT")
    pooling, normalize, max_seq = _sentence_transformers_head(folder)
    max_positions = int(config.get("max_position_embeddings", 512))
    return ModelConfig(
        architecture="bert",
        source_architecture="BertModel",
        name=str(config.get("_name_or_path", "")),
        vocab_size=int(config["vocab_size"]),
        hidden_size=int(config["hidden_size"]),
        num_layers=int(config["num_hidden_layers"]),
        num_heads=int(config["num_attention_heads"]),
        intermediate_size=int(config["intermediate_size"]),
        max_position_embeddings=max_positions,
        norm_eps=float(config.get("layer_norm_eps", 1e-12)),
        type_vocab_size=int(config.get("type_vocab_size", 2)),
        pooling=pooling,
        normalize_embeddings=normalize,
        max_seq_length=min(max_seq or max_positions, max_positions),
    )


def _sentence_transformers_head(folder: Path) -> tuple[str, bool, int | None]:
    """(pooling mode, L2-normalise?, max_seq_length) from a sentence-transformers folder; defaults otherwise."""
    pooling = "mean"
    pooling_file = folder / "1_Pooling" / "config.json"
    if pooling_file.is_file():
        modes = _read_json(pooling_file)
        if modes.get("pooling_mode_cls_token"):
            pooling = "cls"
        elif not modes.get("pooling_mode_mean_tokens", True):
            raise UnsupportedModelError(f"{pooling_file}: only mean or CLS pooling is supported")
    normalize = True
    modules_file = folder / "modules.json"
    if modules_file.is_file():
        modules = _read_json(modules_file)
        normalize = any(str(m.get("type", "")).endswith("Normalize") for m in modules)
    bert_file = folder / "sentence_bert_config.json"
    max_seq = _read_json(bert_file).get("max_seq_length") if bert_file.is_file() else None
    return pooling, normalize, int(max_seq) if max_seq else None


def _generation_eos_ids(folder: Path) -> list[int]:
    path = folder / "generation_config.json"
    if not path.is_file():
        return []
    eos = _read_json(path).get("eos_token_id")
    if eos is None:
        return []
    return [int(e) for e in eos] if isinstance(eos, list) else [int(eos)]


def _chat_template(folder: Path) -> str | None:
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = read_tokenizer_config(folder).get("chat_template")
    if isinstance(template, list):  # named templates: take the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return template if isinstance(template, str) else None


def load_hf_folder(folder: Path) -> Checkpoint:
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ModelFormatError(f"{folder} has no config.json")
    raw_config = _read_json(config_path)
    archs = raw_config.get("architectures") or []
    arch = archs[0] if archs else ""
    if arch in DECODER_ARCHITECTURES:
        config = decoder_config(raw_config, arch)

        def parts_of(file_name: str) -> dict[str, Part] | None:
            return tensor_parts(file_name, arch, config)
    elif arch in ENCODER_ARCHITECTURES:
        config = encoder_config(raw_config, folder)

        def parts_of(file_name: str) -> dict[str, Part] | None:
            name = _encoder_name(file_name)
            return None if name is None else {name: Part(file_name)}
    else:
        raise UnsupportedModelError(
            f"architecture {arch or '(none)'!r} is not supported; rebar runs "
            f"{', '.join(DECODER_ARCHITECTURES + ENCODER_ARCHITECTURES)}"
        )

    infos: dict[str, TensorInfo] = {}
    locations: dict[str, tuple[Path, Part]] = {}
    for file in _safetensors_files(folder):
        try:
            with safe_open(file, framework="pt") as handle:
                for file_name in handle.keys():
                    if _IGNORED.match(file_name):
                        continue
                    parts = parts_of(file_name)
                    if parts is None:
                        raise UnsupportedModelError(f"tensor {file_name!r} in {file.name} has no place in a {arch} model")
                    view = handle.get_slice(file_name)
                    shape = tuple(int(d) for d in view.get_shape())
                    storage = view.get_dtype()
                    for name, part in parts.items():
                        part_shape = shape if part.rows is None else (part.rows[1] - part.rows[0], *shape[1:])
                        if part.rows is not None and part.rows[1] > shape[0]:
                            raise ModelFormatError(f"tensor {file_name!r} has {shape[0]} rows; {name} needs rows "
                                                   f"{part.rows[0]}..{part.rows[1]} from the model config")
                        infos[name] = TensorInfo(name, file_name, part_shape, storage, _num_bytes(part_shape, storage))
                        locations[name] = (file, part)
        except SafetensorError as exc:
            raise ModelFormatError(f"{file} is not a readable safetensors file (truncated or corrupt?): {exc}") from exc

    files = MappedSafetensors()

    def load(name: str, dtype: torch.dtype) -> torch.Tensor:
        file, part = locations[name]
        tensor = files.get_tensor(file, part.file_name)
        if part.rows is not None:
            tensor = tensor[part.rows[0] : part.rows[1]]
        if part.add_one:  # in float32, as the model's own norm computes 1 + w
            return (tensor.float() + 1.0).to(dtype)
        return tensor.to(dtype)

    tokenizer = Tokenizer.from_hf_folder(folder, eos_token_ids=_generation_eos_ids(folder))
    if config.architecture == "bert":
        tokenizer.set_truncation(config.max_seq_length)
    return Checkpoint(
        path=folder,
        format="hf",
        config=config,
        tokenizer=tokenizer,
        chat_template=_chat_template(folder),
        tensors=infos,
        _load=load,
        metadata={k: str(v) for k, v in raw_config.items() if not isinstance(v, (dict, list))},
    )


_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


def _num_bytes(shape: tuple[int, ...], storage: str) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count * _DTYPE_BYTES.get(storage, 4)
