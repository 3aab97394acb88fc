"""A corpus of malformed Hugging Face folders, each a good tiny folder with one file spoiled: every
one must fail to open with a typed error naming the key (or the file) at fault, never a bare
ValueError, KeyError, AttributeError or ZeroDivisionError. GGUF files: test_malformed_models.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import hf_tiny
import pytest

from expect import raises
from needs import need_module
from rebar.errors import ModelFormatError, UnsupportedModelError
from rebar.llm import LLM
from rebar.model.loader import open_checkpoint

need_module("transformers")  # the reference models these tests compare against


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return hf_tiny.save_decoder(
        hf_tiny.build_decoder("LlamaForCausalLM", seed=3), tmp_path_factory.mktemp("llama")
    )


@pytest.fixture(scope="module")
def bert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return hf_tiny.save_bert(
        hf_tiny.build_bert(seed=4), tmp_path_factory.mktemp("bert") / "bert", max_seq_length=32
    )


def copy_with(
    folder: Path,
    tmp_path: Path,
    changes: dict[str, Any] | None = None,
    file: str = "config.json",
    text: str | bytes | None = None,
) -> Path:
    """A copy of `folder` whose `file` has `changes` applied to its JSON object (or is `text`
    outright)."""
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    path = copy / file
    if text is not None:
        (path.write_bytes if isinstance(text, bytes) else path.write_text)(text)
    else:
        values = json.loads(path.read_text()) if path.is_file() else {}
        values.update(changes or {})
        path.write_text(
            json.dumps(values)
        )  # NaN and Infinity are written as JavaScript's, as Python reads them
    return copy


def test_the_good_folders_open(llama: Path, bert: Path) -> None:
    assert open_checkpoint(llama).config.num_heads == 4
    assert open_checkpoint(bert).config.max_seq_length == 32


DIMENSION_KEYS = [
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "num_hidden_layers",
    "intermediate_size",
    "max_position_embeddings",
    "vocab_size",
    "head_dim",
]
BAD_DIMENSIONS = {
    "zero": 0,
    "negative": -4,
    "huge": 2**40,
    "string": "64",
    "bool": True,
    "fraction": 64.5,
    "infinite": float("inf"),
    "nan": float("nan"),
    "list": [64],
    "object": {"value": 64},
}


@pytest.mark.parametrize("value", list(BAD_DIMENSIONS.values()), ids=list(BAD_DIMENSIONS))
@pytest.mark.parametrize("key", DIMENSION_KEYS)
def test_bad_dimension_names_key_and_value(
    llama: Path, tmp_path: Path, key: str, value: Any
) -> None:
    folder = copy_with(llama, tmp_path, {key: value})
    raises(
        ModelFormatError,
        lambda: open_checkpoint(folder),
        repr(key),
        "config.json",
        repr(value)[:20],
    )


@pytest.mark.parametrize(
    "key",
    ["hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size", "vocab_size"],
)
def test_a_required_dimension_that_is_null_or_absent(llama: Path, tmp_path: Path, key: str) -> None:
    raises(
        ModelFormatError,
        lambda: open_checkpoint(copy_with(llama, tmp_path, {key: None})),
        repr(key),
        "missing",
    )


BAD_SCALES = {
    "zero": 0.0,
    "negative": -1e-6,
    "string": "1e-6",
    "nan": float("nan"),
    "infinite": float("inf"),
    "bool": True,
    "list": [1e-6],
    "beyond-float": 10**400,
}


@pytest.mark.parametrize("value", list(BAD_SCALES.values()), ids=list(BAD_SCALES))
@pytest.mark.parametrize("key", ["rms_norm_eps", "rope_theta"])
def test_bad_scale_names_key(llama: Path, tmp_path: Path, key: str, value: Any) -> None:
    raises(
        ModelFormatError,
        lambda: open_checkpoint(copy_with(llama, tmp_path, {key: value})),
        repr(key),
    )


GEMMA_SLIDING = {"architectures": ["Gemma3ForCausalLM"], "sliding_window": 16}
INCONSISTENT: dict[str, tuple[dict[str, Any], list[str]]] = {
    "kv-heads-do-not-divide": (
        {"num_key_value_heads": 3},
        ["'num_attention_heads'", "'num_key_value_heads'"],
    ),
    "hidden-not-a-multiple": (
        {"hidden_size": 66, "head_dim": None},
        ["'hidden_size' = 66", "'num_attention_heads' = 4"],
    ),
    "odd-head-dim": ({"head_dim": 15}, ["'head_dim'", "15"]),
    "architectures-a-string": ({"architectures": "LlamaForCausalLM"}, ["'architectures'"]),
    "architectures-not-strings": ({"architectures": [7]}, ["'architectures'"]),
    "rope-scaling-a-string": (
        {"rope_parameters": None, "rope_scaling": "linear"},
        ["'rope_scaling'"],
    ),
    "rope-parameters-a-list": ({"rope_parameters": [10000.0]}, ["'rope_parameters'"]),
    "rope-factor-zero": (
        {"rope_parameters": {"rope_type": "linear", "factor": 0}},
        ["'rope_parameters'", "'factor'"],
    ),
    "llama3-rope-incomplete": (
        {"rope_parameters": {"rope_type": "llama3", "factor": 8.0}},
        ["'low_freq_factor'"],
    ),
    "llama3-rope-flat": (
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 2.0,
                "high_freq_factor": 2.0,
                "original_max_position_embeddings": 64,
            }
        },
        ["low_freq_factor", "high_freq_factor"],
    ),
    "rope-type-a-number": ({"rope_parameters": {"rope_type": 3}}, ["'rope_type'"]),
    "rope-theta-negative": (
        {"rope_parameters": {"rope_type": "default", "rope_theta": -1.0}},
        ["'rope_theta'"],
    ),
    "gemma-pattern-zero": (
        {**GEMMA_SLIDING, "sliding_window_pattern": 0},
        ["'sliding_window_pattern'"],
    ),
    "window-negative": ({**GEMMA_SLIDING, "sliding_window": -16}, ["'sliding_window'", "-16"]),
    "layer-types-too-many": (
        {**GEMMA_SLIDING, "layer_types": ["sliding_attention"] + ["full_attention"] * 2},
        ["'layer_types'", "3 entries for 2 layers"],
    ),
    "layer-types-not-strings": ({**GEMMA_SLIDING, "layer_types": [1, 0]}, ["'layer_types'"]),
    "attention-scalar-negative": (
        {"architectures": ["Gemma3ForCausalLM"], "query_pre_attn_scalar": -4},
        ["'query_pre_attn_scalar'"],
    ),
    "partial-rotary-a-string": ({"partial_rotary_factor": "half"}, ["'partial_rotary_factor'"]),
    "tied-a-string": ({"tie_word_embeddings": "false"}, ["'tie_word_embeddings'"]),
    "activation-a-list": ({"hidden_act": ["silu"]}, ["'hidden_act'"]),
}


@pytest.mark.parametrize("case", sorted(INCONSISTENT))
def test_inconsistent_config_names_the_keys(llama: Path, tmp_path: Path, case: str) -> None:
    changes, culprits = INCONSISTENT[case]
    raises(
        ModelFormatError, lambda: open_checkpoint(copy_with(llama, tmp_path, changes)), *culprits
    )


NOT_AN_OBJECT = {
    "list": "[1, 2]",
    "string": '"LlamaForCausalLM"',
    "number": "7",
    "null": "null",
    "invalid": '{"hidden_size": 64,',
    "empty": "",
    "not-utf8": b"\xff\xfe{}",
    "5000-digit-number": '{"hidden_size": ' + "9" * 5000 + "}",
}


@pytest.mark.parametrize("text", list(NOT_AN_OBJECT.values()), ids=list(NOT_AN_OBJECT))
@pytest.mark.parametrize("file", ["config.json", "tokenizer_config.json", "generation_config.json"])
def test_a_json_file_that_is_not_an_object(
    llama: Path, tmp_path: Path, file: str, text: str | bytes
) -> None:
    folder = copy_with(llama, tmp_path, file=file, text=text)
    raises(ModelFormatError, lambda: open_checkpoint(folder), file)


SIDE_FILES = {
    "index-map-a-list": (
        "model.safetensors.index.json",
        {"weight_map": ["model.safetensors"]},
        "'weight_map'",
    ),
    "index-shard-a-number": (
        "model.safetensors.index.json",
        {"weight_map": {"lm_head.weight": 5}},
        "'lm_head.weight'",
    ),
    "eos-a-string": ("generation_config.json", {"eos_token_id": "</s>"}, "'eos_token_id'"),
    "eos-list-of-strings": ("generation_config.json", {"eos_token_id": ["</s>"]}, "'eos_token_id'"),
}


@pytest.mark.parametrize("case", sorted(SIDE_FILES))
def test_bad_side_files_name_the_key(llama: Path, tmp_path: Path, case: str) -> None:
    file, changes, culprit = SIDE_FILES[case]
    raises(
        ModelFormatError,
        lambda: open_checkpoint(copy_with(llama, tmp_path, changes, file=file)),
        file,
        culprit,
    )


BERT_CASES = {
    "zero-heads": ("config.json", {"num_attention_heads": 0}, "'num_attention_heads'"),
    "heads-do-not-divide": ("config.json", {"num_attention_heads": 5}, "'num_attention_heads'"),
    "token-types-negative": ("config.json", {"type_vocab_size": -1}, "'type_vocab_size'"),
    "eps-a-string": ("config.json", {"layer_norm_eps": "tiny"}, "'layer_norm_eps'"),
    "max-seq-negative": ("sentence_bert_config.json", {"max_seq_length": -1}, "'max_seq_length'"),
}


@pytest.mark.parametrize("case", sorted(BERT_CASES))
def test_bad_bert_config_names_the_key(bert: Path, tmp_path: Path, case: str) -> None:
    file, changes, culprit = BERT_CASES[case]
    raises(
        ModelFormatError,
        lambda: open_checkpoint(copy_with(bert, tmp_path, changes, file=file)),
        culprit,
    )


@pytest.mark.parametrize("file", ["modules.json", "1_Pooling/config.json"])
def test_bert_side_file_of_the_wrong_kind(bert: Path, tmp_path: Path, file: str) -> None:
    text = '{"type": "Normalize"}' if file == "modules.json" else "[1]"
    raises(
        ModelFormatError,
        lambda: open_checkpoint(copy_with(bert, tmp_path, file=file, text=text)),
        file,
    )


def test_softcapping_is_still_refused_as_unsupported(llama: Path, tmp_path: Path) -> None:
    folder = copy_with(
        llama, tmp_path, {"architectures": ["Gemma3ForCausalLM"], "final_logit_softcapping": 30.0}
    )
    raises(UnsupportedModelError, lambda: open_checkpoint(folder), "final_logit_softcapping")


@pytest.mark.parametrize(
    ("changes", "culprit"),
    [
        ({"num_attention_heads": 0}, "'num_attention_heads'"),
        ({"num_hidden_layers": "2"}, "'num_hidden_layers'"),
        (
            {"intermediate_size": 4096},
            "'model.layers.0.mlp.gate_proj.weight'",
        ),  # in bounds, but not the tensors' shape
    ],
    ids=["zero-heads", "string-layers", "tensors-disagree"],
)
def test_the_engine_loader_raises_the_typed_error(
    llama: Path, tmp_path: Path, changes: dict, culprit: str
) -> None:
    folder = copy_with(llama, tmp_path, changes)
    raises(ModelFormatError, lambda: LLM(model=folder, dtype="float32", device="cpu"), culprit)
