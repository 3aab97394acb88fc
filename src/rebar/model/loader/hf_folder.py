"""Hugging Face folders: `config.json` + `*.safetensors` (single file or sharded with an index).

Tensors are read through `safetensors.safe_open`, which memory-maps the files; no pickle is ever
loaded. Decoder checkpoints (Llama, Mistral, Qwen2) are renamed to rebar's tensor names; BERT
checkpoints keep HF's names, which `rebar.model.bert` mirrors.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from rebar.errors import ModelFormatError, UnsupportedModelError
from rebar.model.config import ModelConfig, RopeScaling
from rebar.model.loader.base import Checkpoint, TensorInfo
from rebar.model.loader.mapped_files import MappedSafetensors
from rebar.model.tokenizer import Tokenizer, read_tokenizer_config

DECODER_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
ENCODER_ARCHITECTURES = ("BertModel",)

_DECODER_LAYER_NAMES = {
    "input_layernorm.weight": "input_norm.weight",
    "post_attention_layernorm.weight": "post_attn_norm.weight",
    **{f"self_attn.{p}.{k}": f"attn.{p}.{k}" for p in ("q_proj", "k_proj", "v_proj", "o_proj") for k in ("weight", "bias")},
    **{f"mlp.{p}.{k}": f"mlp.{p}.{k}" for p in ("gate_proj", "up_proj", "down_proj") for k in ("weight", "bias")},
}
_DECODER_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
# Buffers some exporters save that carry no weights.
_IGNORED = re.compile(r".*(rotary_emb\.inv_freq|position_ids)$|^pooler\..*")


def _decoder_name(file_name: str) -> str | None:
    if file_name == "model.embed_tokens.weight":
        return "embed_tokens.weight"
    if file_name == "model.norm.weight":
        return "norm.weight"
    if file_name == "lm_head.weight":
        return "lm_head.weight"
    match = _DECODER_LAYER.fullmatch(file_name)
    if match and match.group(2) in _DECODER_LAYER_NAMES:
        return f"layers.{match.group(1)}.{_DECODER_LAYER_NAMES[match.group(2)]}"
    return None


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


def _rope(config: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    # transformers 4.x writes rope_theta + rope_scaling; 5.x writes one rope_parameters dict.
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind == "linear":
        return theta, RopeScaling(kind="linear", factor=float(params["factor"]))
    if kind == "llama3":
        return theta, RopeScaling(
            kind="llama3",
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position=int(params["original_max_position_embeddings"]),
        )
    raise UnsupportedModelError(f"rope scaling type {kind!r} is not supported (rebar has linear and llama3)")


def _sliding_window(config: dict[str, Any], arch: str) -> int | None:
    """The window every layer uses, or None; rebar cannot mix windowed and full-attention layers."""
    window = config.get("sliding_window")
    is_qwen2 = arch == "Qwen2ForCausalLM"
    if not window or (is_qwen2 and not config.get("use_sliding_window", False)):
        return None
    layer_types = config.get("layer_types")
    if layer_types is None and is_qwen2:  # transformers 4.x: layers from max_window_layers on are windowed
        first = int(config.get("max_window_layers", 0))
        layer_types = ["sliding_attention" if i >= first else "full_attention" for i in range(int(config["num_hidden_layers"]))]
    kinds = {kind == "sliding_attention" for kind in layer_types or ["sliding_attention"]}
    if kinds == {False}:
        return None
    if kinds == {True}:
        return int(window)
    raise UnsupportedModelError(
        f"{arch} mixes sliding-window and full-attention layers (layer_types {layer_types}); "
        "rebar applies one attention pattern to every layer"
    )


def decoder_config(config: dict[str, Any], arch: str) -> ModelConfig:
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"activation {act!r} is not supported for {arch} (expected silu)")
    hidden = int(config["hidden_size"])
    num_heads = int(config["num_attention_heads"])
    theta, scaling = _rope(config)
    is_qwen2 = arch == "Qwen2ForCausalLM"
    attention_bias = bool(config.get("attention_bias", False))
    return ModelConfig(
        architecture="llama",
        source_architecture=arch,
        name=str(config.get("_name_or_path", "")),
        vocab_size=int(config["vocab_size"]),
        hidden_size=hidden,
        num_layers=int(config["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
        head_dim=int(config.get("head_dim") or hidden // num_heads),
        intermediate_size=int(config["intermediate_size"]),
        max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        qkv_bias=is_qwen2 or attention_bias,
        o_bias=attention_bias,
        mlp_bias=bool(config.get("mlp_bias", False)),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        sliding_window=_sliding_window(config, arch),
    )


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
        config, rename = decoder_config(raw_config, arch), _decoder_name
    elif arch in ENCODER_ARCHITECTURES:
        config, rename = encoder_config(raw_config, folder), _encoder_name
    else:
        raise UnsupportedModelError(
            f"architecture {arch or '(none)'!r} is not supported; rebar runs "
            f"{', '.join(DECODER_ARCHITECTURES + ENCODER_ARCHITECTURES)}"
        )

    infos: dict[str, TensorInfo] = {}
    locations: dict[str, tuple[Path, str]] = {}
    for file in _safetensors_files(folder):
        try:
            with safe_open(file, framework="pt") as handle:
                for file_name in handle.keys():
                    if _IGNORED.match(file_name):
                        continue
                    name = rename(file_name)
                    if name is None:
                        raise UnsupportedModelError(f"tensor {file_name!r} in {file.name} has no place in a {arch} model")
                    view = handle.get_slice(file_name)
                    shape = tuple(int(d) for d in view.get_shape())
                    storage = view.get_dtype()
                    infos[name] = TensorInfo(name, file_name, shape, storage, _num_bytes(shape, storage))
                    locations[name] = (file, file_name)
        except SafetensorError as exc:
            raise ModelFormatError(f"{file} is not a readable safetensors file (truncated or corrupt?): {exc}") from exc

    files = MappedSafetensors()

    def load(name: str, dtype: torch.dtype) -> torch.Tensor:
        file, file_name = locations[name]
        return files.get_tensor(file, file_name).to(dtype)

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
