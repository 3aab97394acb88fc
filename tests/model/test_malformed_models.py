"""A corpus of malformed GGUF files, built here from one good tiny model: every one must fail to
open with a typed error (ModelFormatError, or UnsupportedModelError for a well-formed variant rebar
lacks) whose message names what is wrong: the key, the tensor, or the part of the file that was cut.
Never a RecursionError, ZeroDivisionError, ValueError, MemoryError or a hang. HF folders:
test_malformed_hf.py.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader, GGUFValueType
from gguf_builder import Tensor, TinyConfig, Typed, model_contents

from expect import raises
from rebar.errors import ModelFormatError, UnsupportedModelError
from rebar.llm import LLM
from rebar.model.loader import open_checkpoint
from rebar.model.loader.gguf_metadata import ARRAY, MAX_ARRAY_DEPTH, STRING

HEADER_BYTES = 24  # magic, version, tensor count, metadata count


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return model_contents(TinyConfig()).write(tmp_path_factory.mktemp("good") / "tiny.gguf")


@pytest.fixture(scope="module")
def layout(good: Path) -> dict[str, Any]:
    """Where the good file's parts lie, read by the `gguf` package (an independent reader)."""
    reader = GGUFReader(good)
    tensors = sorted(reader.tensors, key=lambda t: int(t.data_offset))
    return {
        "index_start": min(int(t.field.offset) for t in reader.tensors),
        "data_start": int(reader.data_offset),
        "tensors": [
            (t.name, int(t.data_offset), int(t.n_bytes)) for t in tensors
        ],  # absolute offsets
    }


def written(data: bytes, tmp_path: Path, name: str = "bad.gguf") -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


def test_the_good_file_opens(good: Path) -> None:
    assert open_checkpoint(good).config.num_layers == 2


# ----- truncation ---------------------------------------------------------------------------------


@pytest.mark.parametrize("cut", [0, 2, 4, 6, 8, 12, 16, 20])
def test_cut_in_the_header(good: Path, tmp_path: Path, cut: int) -> None:
    path = written(good.read_bytes()[:cut], tmp_path)
    raises(ModelFormatError, lambda: open_checkpoint(path), str(path))


@pytest.mark.parametrize("fraction", [0.0, 0.01, 0.1, 0.25, 0.4, 0.5, 0.6, 0.75, 0.9, 0.99, 1.0])
@pytest.mark.parametrize("part", ["metadata", "tensor index"])
def test_cut_in_the_metadata_or_index_names_the_part(
    good: Path, layout: dict, tmp_path: Path, part: str, fraction: float
) -> None:
    start, end = (
        (HEADER_BYTES, layout["index_start"])
        if part == "metadata"
        else (layout["index_start"], layout["data_start"])
    )
    cut = start + int((end - start - 1) * fraction)
    path = written(good.read_bytes()[:cut], tmp_path)
    message = raises(ModelFormatError, lambda: open_checkpoint(path), str(path), "truncated")
    assert (part.split()[0] in message) if part == "metadata" else ("tensor" in message)


@pytest.mark.parametrize("which", [0, 1, 7, 13, 20])
@pytest.mark.parametrize("where", [0.0, 0.5, 0.999])
def test_cut_in_tensor_data_names_the_tensor(
    good: Path, layout: dict, tmp_path: Path, which: int, where: float
) -> None:
    name, offset, num_bytes = layout["tensors"][which]
    path = written(good.read_bytes()[: offset + max(1, int(num_bytes * where))], tmp_path)
    raises(ModelFormatError, lambda: open_checkpoint(path), "truncated", repr(name))


# ----- forged counts, lengths and nesting ---------------------------------------------------------


def _string(text: str) -> bytes:
    return struct.pack("<Q", len(text)) + text.encode()


def with_entry(good: Path, entry: bytes) -> bytes:
    """The good file with one more metadata entry (raw bytes), read before all the others."""
    data = good.read_bytes()
    (num_kv,) = struct.unpack_from("<Q", data, 16)
    return data[:16] + struct.pack("<Q", num_kv + 1) + entry + data[HEADER_BYTES:]


def nested_arrays(key: str, depth: int) -> bytes:
    """Metadata `key` holding one array in one array ... `depth` deep, the innermost empty."""
    innermost = struct.pack("<IQ", 0, 0)  # an empty array of uint8
    return (
        _string(key)
        + struct.pack("<I", ARRAY)
        + struct.pack("<IQ", ARRAY, 1) * (depth - 1)
        + innermost
    )


@pytest.mark.parametrize("depth", [MAX_ARRAY_DEPTH + 1, 100, 10_000])
def test_deeply_nested_arrays_are_refused_by_key(good: Path, tmp_path: Path, depth: int) -> None:
    path = written(with_entry(good, nested_arrays("evil.nesting", depth)), tmp_path)
    raises(ModelFormatError, lambda: open_checkpoint(path), "'evil.nesting'", "nests arrays")


def test_modest_nesting_still_reads(good: Path, tmp_path: Path) -> None:
    """Arrays of arrays within the bound are legal GGUF and read back (padded so the data stays
    aligned)."""
    entry = nested_arrays("ok.nesting", MAX_ARRAY_DEPTH)
    key = "ok.nesting" + "x" * (-len(entry) % 32)
    path = written(with_entry(good, nested_arrays(key, MAX_ARRAY_DEPTH)), tmp_path)
    value = open_checkpoint(path).metadata[key]
    assert value.count("[") == MAX_ARRAY_DEPTH


FORGED = {
    "scalar-array": lambda key: _string(key) + struct.pack("<IIQ", ARRAY, 4, 2**60),
    "string-array": lambda key: _string(key) + struct.pack("<IIQ", ARRAY, STRING, 2**60),
    "array-array": lambda key: _string(key) + struct.pack("<IIQ", ARRAY, ARRAY, 2**60),
    "string": lambda key: _string(key) + struct.pack("<IQ", STRING, 2**60) + b"abc",
    "string-max": lambda key: _string(key) + struct.pack("<IQ", STRING, 2**64 - 1),
    "unknown-item-type": lambda key: _string(key) + struct.pack("<IIQ", ARRAY, 99, 1),
}


@pytest.mark.parametrize("kind", sorted(FORGED))
def test_lengths_beyond_the_file_fail_fast_naming_the_key(
    good: Path, tmp_path: Path, kind: str
) -> None:
    path = written(with_entry(good, FORGED[kind]("evil.length")), tmp_path)
    raises(ModelFormatError, lambda: open_checkpoint(path), "'evil.length'")


def test_a_key_length_beyond_the_file(good: Path, tmp_path: Path) -> None:
    path = written(with_entry(good, struct.pack("<Q", 2**60)), tmp_path)
    raises(ModelFormatError, lambda: open_checkpoint(path), "truncated", "key of metadata entry 0")


@pytest.mark.parametrize(("offset", "what"), [(8, "tensor index"), (16, "metadata count")])
def test_header_counts_beyond_the_file(good: Path, tmp_path: Path, offset: int, what: str) -> None:
    data = bytearray(good.read_bytes())
    struct.pack_into("<Q", data, offset, 2**60)
    path = written(bytes(data), tmp_path)
    raises(ModelFormatError, lambda: open_checkpoint(path), what, str(2**60))


def index_entry(data: bytes, name: str) -> int:
    """Byte offset of tensor `name`'s dimension count in the tensor index."""
    encoded = name.encode()
    return data.index(struct.pack("<Q", len(encoded)) + encoded) + 8 + len(encoded)


def _offset_field(data: bytes, name: str) -> int:
    """Byte offset of tensor `name`'s data offset in the tensor index."""
    at = index_entry(data, name)
    (num_dims,) = struct.unpack_from("<I", data, at)
    return at + 4 + 8 * num_dims + 4


def _patch_index(good: Path, name: str, edit: Callable[[bytearray, int, int], None]) -> bytes:
    """The good file with `edit(data, where the dimension count is, where the data offset is)`
    applied."""
    data = bytearray(good.read_bytes())
    edit(data, index_entry(bytes(data), name), _offset_field(bytes(data), name))
    return bytes(data)


def test_too_many_tensor_dimensions_name_the_tensor(good: Path, tmp_path: Path) -> None:
    data = _patch_index(
        good, "blk.0.ffn_up.weight", lambda d, dims, _: struct.pack_into("<I", d, dims, 2**31)
    )
    path = written(data, tmp_path)
    raises(ModelFormatError, lambda: open_checkpoint(path), "'blk.0.ffn_up.weight'", "dimensions")


def test_misaligned_tensor_offset_names_the_tensor(good: Path, tmp_path: Path) -> None:
    def shift(data: bytearray, _: int, offset_at: int) -> None:
        (offset,) = struct.unpack_from("<Q", data, offset_at)
        struct.pack_into("<Q", data, offset_at, offset + 2)

    path = written(_patch_index(good, "blk.1.ffn_down.weight", shift), tmp_path)
    raises(ModelFormatError, lambda: open_checkpoint(path), "'blk.1.ffn_down.weight'", "alignment")


def test_overlapping_tensors_are_named(good: Path, tmp_path: Path) -> None:
    """Two index entries pointing into the same bytes: a corrupt index, refused naming both."""
    up_offset_at = _offset_field(good.read_bytes(), "blk.0.ffn_up.weight")
    (shared,) = struct.unpack_from("<Q", good.read_bytes(), up_offset_at)
    data = _patch_index(
        good, "blk.0.ffn_gate.weight", lambda d, _, at: struct.pack_into("<Q", d, at, shared)
    )
    path = written(data, tmp_path)
    raises(
        ModelFormatError,
        lambda: open_checkpoint(path),
        "overlap",
        "'blk.0.ffn_up.weight'",
        "'blk.0.ffn_gate.weight'",
    )


# ----- values that do not fit their key -----------------------------------------------------------

DIMENSION_KEYS = [
    "llama.block_count",
    "llama.embedding_length",
    "llama.attention.head_count",
    "llama.attention.head_count_kv",
    "llama.feed_forward_length",
    "llama.context_length",
    "llama.vocab_size",
    "llama.attention.key_length",
    "llama.rope.dimension_count",
]
BAD_DIMENSIONS = {
    "zero": 0,
    "negative": Typed(-4, GGUFValueType.INT32),
    "huge": Typed(2**40, GGUFValueType.UINT64),
    "string": "64",
    "bool": True,
    "fraction": 64.5,
    "infinite": Typed(float("inf"), GGUFValueType.FLOAT32),
    "array": [64],
}


def with_metadata(tmp_path: Path, changes: dict[str, Any], arch: str = "llama") -> Path:
    contents = model_contents(TinyConfig())
    if arch != "llama":  # the same tiny model under another family's keys
        contents.arch = arch
        contents.metadata = {
            k.replace("llama.", f"{arch}.", 1): v for k, v in contents.metadata.items()
        }
    for key, value in changes.items():
        if value is None:
            del contents.metadata[key]
        else:
            contents.metadata[key] = value
    return contents.write(tmp_path / "edited.gguf")


@pytest.mark.parametrize("value", list(BAD_DIMENSIONS.values()), ids=list(BAD_DIMENSIONS))
@pytest.mark.parametrize("key", DIMENSION_KEYS)
def test_bad_dimension_names_key_and_value(tmp_path: Path, key: str, value: Any) -> None:
    path = with_metadata(tmp_path, {key: value})
    shown = value.value if isinstance(value, Typed) else value
    raises(ModelFormatError, lambda: open_checkpoint(path), repr(key), repr(shown))


SCALE_KEYS = ["llama.attention.layer_norm_rms_epsilon", "llama.rope.freq_base"]
BAD_SCALES = {
    "zero": 0.0,
    "negative": -1e-5,
    "nan": float("nan"),
    "inf": float("inf"),
    "string": "1e-5",
    "bool": False,
}


@pytest.mark.parametrize("value", list(BAD_SCALES.values()), ids=list(BAD_SCALES))
@pytest.mark.parametrize("key", SCALE_KEYS)
def test_bad_scale_names_key(tmp_path: Path, key: str, value: Any) -> None:
    path = with_metadata(tmp_path, {key: value})
    raises(ModelFormatError, lambda: open_checkpoint(path), repr(key))


INCONSISTENT = {
    "kv-heads-do-not-divide": (
        {"llama.attention.head_count_kv": 3},
        ["'llama.attention.head_count'", "'llama.attention.head_count_kv'"],
    ),
    "hidden-not-a-multiple": (
        {"llama.embedding_length": 66, "llama.rope.dimension_count": None},
        ["'llama.embedding_length' = 66", "'llama.attention.head_count' = 4"],
    ),
    "odd-head-dim": (
        {"llama.attention.key_length": 15, "llama.rope.dimension_count": 15},
        ["head_dim", "15", "'llama.attention.key_length'"],
    ),
    "token-types-short": (
        {"tokenizer.ggml.token_type": [1, 1, 1]},
        ["'tokenizer.ggml.token_type'", "3 entries"],
    ),
    "bos-out-of-range": (
        {"tokenizer.ggml.bos_token_id": 5000},
        ["'tokenizer.ggml.bos_token_id'", "5000"],
    ),
    "eos-a-string": ({"tokenizer.ggml.eos_token_id": "</s>"}, ["'tokenizer.ggml.eos_token_id'"]),
    "tokens-not-strings": (
        {"tokenizer.ggml.tokens": list(range(268))},
        ["'tokenizer.ggml.tokens'"],
    ),
    "merges-unknown-tokens": ({"tokenizer.ggml.merges": ["zz qq"]}, ["merges"]),
    "architecture-a-number": (
        {"general.architecture": Typed(7, GGUFValueType.UINT32)},
        ["'general.architecture'"],
    ),
    "template-a-number": ({"tokenizer.chat_template": 3}, ["'tokenizer.chat_template'"]),
    "rope-factor-negative": (
        {"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": -2.0},
        ["'llama.rope.scaling.factor'"],
    ),
    "add-bos-a-string": (
        {"tokenizer.ggml.add_bos_token": "yes"},
        ["'tokenizer.ggml.add_bos_token'"],
    ),
    "alignment-not-a-power-of-two": ({"general.alignment": 48}, ["general.alignment"]),
}


@pytest.mark.parametrize("case", sorted(INCONSISTENT))
def test_inconsistent_metadata_names_the_keys(tmp_path: Path, case: str) -> None:
    changes, culprits = INCONSISTENT[case]
    path = with_metadata(tmp_path, changes)
    raises(ModelFormatError, lambda: open_checkpoint(path), *culprits)


def test_gemma3_layer_pattern_that_disagrees_with_the_layers(tmp_path: Path) -> None:
    path = with_metadata(
        tmp_path,
        {
            "gemma3.attention.sliding_window": 16,
            "gemma3.attention.sliding_window_pattern": [True, False, True],
        },
        arch="gemma3",
    )
    raises(
        ModelFormatError,
        lambda: open_checkpoint(path),
        "'gemma3.attention.sliding_window_pattern'",
        "3 entries",
    )


def test_partial_rotary_is_still_refused_as_unsupported(tmp_path: Path) -> None:
    path = with_metadata(tmp_path, {"llama.rope.dimension_count": 8})
    raises(UnsupportedModelError, lambda: open_checkpoint(path), "partial rotary")


# ----- through the loader `rebar serve` uses ------------------------------------------------------


def load(path: Path) -> LLM:
    return LLM(model=path, dtype="float32", device="cpu")


@pytest.mark.parametrize(
    "case", ["zero-heads", "string-layers", "nested", "cut-data", "too-wide-for-the-tensors"]
)
def test_the_engine_loader_raises_the_typed_error(
    good: Path, layout: dict, tmp_path: Path, case: str
) -> None:
    if case == "zero-heads":
        path, culprit = (
            with_metadata(tmp_path, {"llama.attention.head_count": 0}),
            "'llama.attention.head_count'",
        )
    elif case == "string-layers":
        path, culprit = with_metadata(tmp_path, {"llama.block_count": "2"}), "'llama.block_count'"
    elif case == "nested":
        path, culprit = written(with_entry(good, nested_arrays("evil", 10_000)), tmp_path), "'evil'"
    elif case == "cut-data":
        name, offset, _ = layout["tensors"][-1]
        path, culprit = written(good.read_bytes()[: offset + 10], tmp_path), repr(name)
    # in bounds, but the tensors are for another shape: the build names the first mismatched tensor
    else:
        path, culprit = (
            with_metadata(tmp_path, {"llama.feed_forward_length": 2**20}),
            "from the model config",
        )
    raises(ModelFormatError, lambda: load(path), culprit)


def test_a_wrongly_shaped_tensor_is_named_by_the_engine_loader(tmp_path: Path) -> None:
    contents = model_contents(TinyConfig())
    contents.tensors["blk.1.attn_v.weight"] = Tensor(np.zeros((33, 64), np.float32), QT.F32)
    path = contents.write(tmp_path / "shape.gguf")
    raises(ModelFormatError, lambda: load(path), "'blk.1.attn_v.weight'", "[33, 64]", "[32, 64]")


@pytest.mark.parametrize(
    ("factors", "problem"),
    [(np.ones(3), "shape [3]"), (np.zeros(8), "not finite")],
    ids=["wrong-length", "zero"],
)
def test_bad_rope_frequency_factors_are_named(
    tmp_path: Path, factors: np.ndarray, problem: str
) -> None:
    contents = model_contents(TinyConfig())
    contents.tensors["rope_freqs.weight"] = Tensor(factors.astype(np.float32), QT.F32)
    path = contents.write(tmp_path / "freqs.gguf")
    raises(ModelFormatError, lambda: load(path), "'rope_freqs.weight'", problem)
