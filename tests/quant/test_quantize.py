"""The quantize pipeline's choices and refusals (the numbers themselves are tested in
test_checkpoint.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tiny_quant import tiny_gguf

from needs import need_module
from rebar.errors import InvalidRequestError
from rebar.model.loader import open_checkpoint
from rebar.model.loader.rebar_quant import MANIFEST_NAME
from rebar.quant.calib_data import JsonlDataset
from rebar.quant.quantize import QuantizeSpec, calibration_sequences, quantize, source_digest


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"method": "int3"}, "method"),
        ({"method": "int4-rtn", "group_size": 0}, "group_size"),
        ({"method": "int4-rtn", "group_size": 33}, "group_size"),
        ({"method": "int4-awq"}, "calib"),
        ({"method": "int8", "calib_path": Path("c.jsonl")}, "calib"),
        ({"method": "int4-rtn", "calib_path": Path("c.jsonl")}, "calib"),
        ({"method": "int4-awq", "calib_path": Path("c.jsonl"), "calib_sequences": 0}, "calib"),
    ],
)
def test_bad_specs_name_the_parameter(kwargs: dict, param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        QuantizeSpec(**kwargs)
    assert info.value.param == param


def test_group_size_defaults() -> None:
    assert QuantizeSpec("int8").effective_group_size is None
    assert QuantizeSpec("int8", group_size=32).effective_group_size == 32
    assert QuantizeSpec("int4-rtn").effective_group_size == 64
    assert QuantizeSpec("int4-rtn").bits == 4 and QuantizeSpec("int8").bits == 8


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_gguf(tmp_path_factory.mktemp("quantize"))[0]


def test_group_size_that_does_not_tile_a_layer_is_refused_before_any_work(
    source: Path, tmp_path: Path
) -> None:
    with pytest.raises(
        InvalidRequestError,
        match=r"group size 128 does not divide layers\.0\.attn\.q_proj's 64 input channels",
    ):
        quantize(source, QuantizeSpec("int4-rtn", group_size=128), tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_output_folder_must_be_new_or_empty(source: Path, tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("x")
    with pytest.raises(InvalidRequestError, match="not empty") as info:
        quantize(source, QuantizeSpec("int8"), tmp_path / "out", progress=False)
    assert info.value.param == "out"


def test_embedding_models_are_refused(tmp_path: Path) -> None:
    need_module("transformers")
    import hf_tiny

    folder = hf_tiny.save_bert(hf_tiny.build_bert(seed=1), tmp_path / "bert")
    with pytest.raises(InvalidRequestError, match="embedding model"):
        quantize(folder, QuantizeSpec("int8"), tmp_path / "out", progress=False)


def write_corpus(path: Path, texts: list[str]) -> Path:
    """One good record, then one broken line, and so on."""
    path.write_text(
        "".join(json.dumps({"text": t}) + "\nbroken line\n" for t in texts), encoding="utf-8"
    )
    return path


def test_calibration_sequences_are_deterministic_windows(source: Path, tmp_path: Path) -> None:
    tokenizer = open_checkpoint(source).tokenizer
    corpus = write_corpus(tmp_path / "c.jsonl", [f"the and then {i} " * 5 for i in range(40)])
    with JsonlDataset(corpus) as dataset:
        first = calibration_sequences(dataset, tokenizer, 4, 16, seed=0)
        assert len(first) == 4 and all(len(s) == 16 for s in first)
        assert calibration_sequences(dataset, tokenizer, 4, 16, seed=0) == first
        assert calibration_sequences(dataset, tokenizer, 4, 16, seed=1) != first
        with pytest.raises(InvalidRequestError, match="too little usable text"):
            calibration_sequences(dataset, tokenizer, 1000, 64, seed=0)


def test_awq_records_its_calibration_in_the_manifest(source: Path, tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "c.jsonl", [f"the and then {i} " * 8 for i in range(40)])
    spec = QuantizeSpec(
        "int4-awq", group_size=32, calib_path=corpus, calib_sequences=8, calib_seq_len=64, seed=3
    )
    result = quantize(source, spec, tmp_path / "out", progress=False)
    assert (
        result.awq is not None and len(result.awq.searches) == 8 and len(result.awq.grids) == 14
    )  # 2 layers x 4 groups, 7 linears
    calibration = json.loads((tmp_path / "out" / MANIFEST_NAME).read_text())["calibration"]
    skipped = calibration.pop("bad_lines_skipped")
    assert calibration == {
        "file": str(corpus),
        "sha256": source_digest(corpus),
        "text_field": "text",
        "sequences": 8,
        "seq_len": 64,
        "seed": 3,
        "rounding": "error feedback",
    }
    with JsonlDataset(corpus) as dataset:  # the same draw again, to count the broken lines it meets
        calibration_sequences(dataset, open_checkpoint(source).tokenizer, 8, 64, seed=3)
        assert skipped == len(dataset.bad_lines) >= 1
    checkpoint = open_checkpoint(tmp_path / "out")
    norm = checkpoint.load_tensor("layers.0.input_norm.weight", torch.float32)
    original = open_checkpoint(source).load_tensor("layers.0.input_norm.weight", torch.float32)
    assert not torch.equal(norm, original)  # activation-aware scales were folded into the norm


def test_source_digest_covers_names_and_contents(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x.bin").write_bytes(b"123")
    first = source_digest(tmp_path / "a")
    (tmp_path / "a" / "x.bin").write_bytes(b"124")
    second = source_digest(tmp_path / "a")
    (tmp_path / "a" / "x.bin").rename(tmp_path / "a" / "y.bin")
    assert len({first, second, source_digest(tmp_path / "a")}) == 3
    assert source_digest(tmp_path / "a" / "y.bin") != second
