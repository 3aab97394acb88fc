"""Hugging Face folders: `config.json` + `*.safetensors` (single file or sharded with an index).

Tensors are read through `safetensors.safe_open`, which memory-maps the files; no pickle is ever
loaded. Decoder checkpoints (the Llama family: hf_decoders.py) are renamed to rebar's tensor names,
fused tensors split; BERT checkpoints keep HF's names, which `rebar.model.bert` mirrors.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from rebar.errors import ModelFormatError, UnsupportedModelError
from rebar.model.config import ModelConfig
from rebar.model.loader.base import Checkpoint, TensorInfo
from rebar.model.loader.config_values import ConfigValues
from rebar.model.loader.hf_decoders import DECODER_ARCHITECTURES, Part, decoder_config, tensor_parts
from rebar.model.loader.mapped_files import MappedSafetensors
from rebar.model.tokenizer import Tokenizer, read_tokenizer_config

ENCODER_ARCHITECTURES = ("BertModel",)
# Buffers some exporters save that carry no weights.
_IGNORED = re.compile(r".*(rotary_emb\.inv_freq|position_ids)$|^pooler\..*")


def _encoder_name(file_name: str) -> str | None:
    name = file_name.removeprefix("bert.")
    return name if name.startswith(("embeddings.", "encoder.")) else None


def _read_json(path: Path, kind: type = dict) -> Any:
    """The JSON in `path`, which must be a `kind` (an object unless said otherwise)."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (
        UnicodeDecodeError,
        ValueError,
    ) as exc:  # ValueError: JSONDecodeError, or an integer of 4,300+ digits
        raise ModelFormatError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(value, kind):
        raise ModelFormatError(
            f"{path} holds {_JSON_KINDS.get(type(value), 'a value')} where "
            f"{_JSON_KINDS[kind]} belongs"
        )
    return value


_JSON_KINDS = {
    dict: "an object",
    list: "an array",
    str: "a string",
    int: "a number",
    float: "a number",
    bool: "a boolean",
    type(None): "null",
}


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = ConfigValues(_read_json(index), str(index)).section("weight_map")
        shards = sorted({weight_map.string(name) for name in weight_map.names()})
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            raise ModelFormatError(f"{index.name} names shards that are missing: {missing}")
        return [folder / s for s in shards]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelFormatError(
            f"{folder} has no *.safetensors weights (pickled .bin files are never loaded)"
        )
    return files


def encoder_config(config: ConfigValues, folder: Path) -> ModelConfig:
    act = config.string("hidden_act", "gelu")
    if act != "gelu":
        raise UnsupportedModelError(f"BERT activation {act!r} is not supported (expected gelu)")
    if config.string("position_embedding_type", "absolute") != "absolute":
        raise UnsupportedModelError("only absolute position embeddings are supported for BERT")
    pooling, normalize, max_seq = _sentence_transformers_head(folder)
    max_positions = config.dimension("max_position_embeddings", "max_position_embeddings", 512)
    return config.model_config(
        architecture="bert",
        source_architecture="BertModel",
        name=str(config.raw("_name_or_path", "")),
        vocab_size=config.dimension("vocab_size", "vocab_size"),
        hidden_size=config.dimension("hidden_size", "hidden_size"),
        num_layers=config.dimension("num_hidden_layers", "num_layers"),
        num_heads=config.dimension("num_attention_heads", "num_heads"),
        intermediate_size=config.dimension("intermediate_size", "intermediate_size"),
        max_position_embeddings=max_positions,
        norm_eps=config.number("layer_norm_eps", 1e-12),
        type_vocab_size=config.dimension("type_vocab_size", "type_vocab_size", 2),
        pooling=pooling,
        normalize_embeddings=normalize,
        max_seq_length=min(max_seq or max_positions, max_positions),
    )


def _sentence_transformers_head(folder: Path) -> tuple[str, bool, int | None]:
    """(pooling mode, L2-normalise?, max_seq_length) from a sentence-transformers folder; defaults
    otherwise."""
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
        modules = _read_json(modules_file, list)
        normalize = any(
            isinstance(m, dict) and str(m.get("type", "")).endswith("Normalize") for m in modules
        )
    bert_file = folder / "sentence_bert_config.json"
    if not bert_file.is_file():
        return pooling, normalize, None
    head = ConfigValues(_read_json(bert_file), str(bert_file))
    max_seq = (
        head.dimension("max_seq_length", "max_seq_length")
        if head.raw("max_seq_length", None)
        else None
    )
    return pooling, normalize, max_seq


def _generation_eos_ids(folder: Path) -> list[int]:
    path = folder / "generation_config.json"
    if not path.is_file():
        return []
    generation = ConfigValues(_read_json(path), str(path))
    if isinstance(generation.raw("eos_token_id", None), list):
        return generation.list_of("eos_token_id", "integers")
    eos = generation.token_id("eos_token_id")
    return [] if eos is None else [eos]


def _chat_template(folder: Path) -> str | None:
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        try:
            return jinja_file.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise ModelFormatError(f"{jinja_file} is not UTF-8 text: {exc}") from exc
    template = read_tokenizer_config(folder).get("chat_template")
    if isinstance(template, list):  # named templates: take the default one
        named = (t for t in template if isinstance(t, dict) and t.get("name") == "default")
        template = next((t.get("template") for t in named), None)
    return template if isinstance(template, str) else None


def _architecture(config: ConfigValues) -> str:
    archs = config.list_of("architectures", "strings", [])
    return archs[0] if archs else ""


def load_hf_folder(folder: Path) -> Checkpoint:
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ModelFormatError(f"{folder} has no config.json")
    raw_config = _read_json(config_path)
    values = ConfigValues(raw_config, str(config_path))
    arch = _architecture(values)
    config, parts_of = _config_and_parts(values, arch, folder)
    infos, locations = _tensor_index(folder, arch, parts_of)
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


PartsOf = Callable[[str], "dict[str, Part] | None"]


def _config_and_parts(values: ConfigValues, arch: str, folder: Path) -> tuple[ModelConfig, PartsOf]:
    """The model's config, and where each file tensor's values go (None: nowhere)."""
    if arch in DECODER_ARCHITECTURES:
        config = decoder_config(values, arch)
        return config, lambda file_name: tensor_parts(file_name, arch, config)
    if arch in ENCODER_ARCHITECTURES:

        def encoder_parts(file_name: str) -> dict[str, Part] | None:
            name = _encoder_name(file_name)
            return None if name is None else {name: Part(file_name)}

        return encoder_config(values, folder), encoder_parts
    raise UnsupportedModelError(
        f"architecture {arch or '(none)'!r} is not supported; rebar runs "
        f"{', '.join(DECODER_ARCHITECTURES + ENCODER_ARCHITECTURES)}"
    )


def _tensor_index(
    folder: Path, arch: str, parts_of: PartsOf
) -> tuple[dict[str, TensorInfo], dict[str, tuple[Path, Part]]]:
    """Each rebar tensor's description and its (file, part); unreadable files and tensors with no
    place in the model are refused."""
    infos: dict[str, TensorInfo] = {}
    locations: dict[str, tuple[Path, Part]] = {}
    for file in _safetensors_files(folder):
        try:
            with safe_open(file, framework="pt") as handle:
                for file_name in handle.keys():  # noqa: SIM118 - safe_open is not iterable
                    if _IGNORED.match(file_name):
                        continue
                    parts = parts_of(file_name)
                    if parts is None:
                        raise UnsupportedModelError(
                            f"tensor {file_name!r} in {file.name} has no place in a {arch} model"
                        )
                    view = handle.get_slice(file_name)
                    shape = tuple(int(d) for d in view.get_shape())
                    for name, part in parts.items():
                        infos[name] = _part_info(name, file_name, part, shape, view.get_dtype())
                        locations[name] = (file, part)
        except SafetensorError as exc:
            raise ModelFormatError(
                f"{file} is not a readable safetensors file (truncated or corrupt?): {exc}"
            ) from exc
    return infos, locations


def _part_info(
    name: str, file_name: str, part: Part, shape: tuple[int, ...], storage: str
) -> TensorInfo:
    if part.rows is not None and part.rows[1] > shape[0]:
        raise ModelFormatError(
            f"tensor {file_name!r} has {shape[0]} rows; {name} needs rows "
            f"{part.rows[0]}..{part.rows[1]} from the model config"
        )
    part_shape = shape if part.rows is None else (part.rows[1] - part.rows[0], *shape[1:])
    return TensorInfo(name, file_name, part_shape, storage, _num_bytes(part_shape, storage))


_DTYPE_BYTES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
}


def _num_bytes(shape: tuple[int, ...], storage: str) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count * _DTYPE_BYTES.get(storage, 4)
