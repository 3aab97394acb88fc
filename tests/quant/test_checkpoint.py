"""rebar's quantized checkpoint: what it holds, what it loads into, and how it fails when damaged."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_quant import IDS, TEMPLATE, hf_logits, quantized_state, tiny_gguf, use_reference_kernels

from needs import need_linux_proc, need_module, requires
from rebar import LLM
from rebar.errors import ModelFormatError
from rebar.llm import engine_config
from rebar.model.loader import open_checkpoint
from rebar.model.loader.rebar_quant import (
    MANIFEST_NAME,
    load_quantized_checkpoint,
    write_checkpoint,
)
from rebar.quant.quantize import QuantizeSpec, quantize, source_digest
from rebar.weights.qlinear import QuantEmbedding, QuantLinear

need_module("transformers")

FLOAT32_KV = engine_config(kv_cache_dtype="float32")  # transformers keeps K/V in float32 too


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One tiny GGUF (untied) quantized three ways, plus a tied one in int4."""
    folder = tmp_path_factory.mktemp("ckpt")
    source, cfg, state = tiny_gguf(folder)
    tied_source, tied_cfg, tied_state = tiny_gguf(folder, tied=True)
    out = {
        "source": source,
        "cfg": cfg,
        "state": state,
        "tied_cfg": tied_cfg,
        "tied_state": tied_state,
    }
    for key, model, spec in [
        ("int8", source, QuantizeSpec("int8")),
        ("int8-g32", source, QuantizeSpec("int8", group_size=32)),
        ("int4", source, QuantizeSpec("int4-rtn", group_size=32)),
        ("int4-tied", tied_source, QuantizeSpec("int4-rtn", group_size=64)),
    ]:
        out[key] = quantize(model, spec, folder / key, progress=False).folder
    return out


@pytest.mark.parametrize(
    ("key", "method", "group_size", "tied"),
    [
        ("int8", "int8", None, False),
        ("int8-g32", "int8", 32, False),
        ("int4", "int4-rtn", 32, False),
        ("int4-tied", "int4-rtn", 64, True),
    ],
)
def test_loaded_checkpoint_computes_the_dequantized_model(
    made: dict, key: str, method: str, group_size: int | None, tied: bool
) -> None:
    """With the float32 dequantize arithmetic pinned, logits equal transformers' on the
    quantized-then-dequantized weights: the checkpoint holds exactly those weights."""
    cfg, state = (made["tied_cfg"], made["tied_state"]) if tied else (made["cfg"], made["state"])
    llm = LLM(model=made[key], device="cpu", engine_config=FLOAT32_KV)
    use_reference_kernels(llm.model)
    expected = hf_logits(cfg, quantized_state(state, method, group_size), IDS)
    torch.testing.assert_close(llm.logits(IDS), expected, atol=2e-4, rtol=0)
    assert isinstance(llm.model.layers[0].mlp.down_proj, QuantLinear)
    assert isinstance(llm.model.embed_tokens, QuantEmbedding)
    assert isinstance(llm.model.lm_head, QuantLinear)  # tied: shares the embedding's codes
    if tied:
        assert llm.model.lm_head.weight_q is llm.model.embed_tokens.weight_q


def test_short_prompts_take_the_packed_kernels_and_stay_close(made: dict) -> None:
    llm = LLM(model=made["int4"], device="cpu")
    assert llm.model.layers[0].attn.q_proj.kernel_for(len(IDS[:8])).name in ("native", "int4pack")
    expected = hf_logits(made["cfg"], quantized_state(made["state"], "int4-rtn", 32), IDS[:8])
    got = llm.logits(IDS[:8])
    # Activations rounded to int8 per block of 32 (rebar's kernel) or to bf16 (torch's): this random
    # model's nearly flat logits move by up to ~10% of their range, so near-ties may flip; every
    # prediction stays among the reference's top three.
    assert (got - expected).abs().max() < 0.15 * expected.abs().max()
    top3 = expected.topk(3, dim=-1).indices
    assert all(int(g) in top3[i].tolist() for i, g in enumerate(got.argmax(-1)))
    assert (got.argmax(-1) == expected.argmax(-1)).sum() >= 6
    out = llm.generate(
        [IDS[:5]], __import__("rebar").SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    )[0]
    assert len(out.token_ids) == 4


def test_dequantize_flag_expands_every_weight(made: dict) -> None:
    llm = LLM(model=made["int4"], device="cpu", dequantize=True, engine_config=FLOAT32_KV)
    assert type(llm.model.layers[0].attn.q_proj) is torch.nn.Linear
    expected = hf_logits(made["cfg"], quantized_state(made["state"], "int4-rtn", 32), IDS)
    torch.testing.assert_close(llm.logits(IDS), expected, atol=2e-4, rtol=0)


def test_manifest_records_how_it_was_made(made: dict) -> None:
    manifest = json.loads((made["int4"] / MANIFEST_NAME).read_text())
    assert manifest["format"] == "rebar-quant" and manifest["format_version"] == 1
    assert (manifest["method"], manifest["bits"], manifest["group_size"]) == ("int4-rtn", 4, 32)
    assert manifest["tool"].startswith("rebar ")
    assert (
        manifest["source"]["sha256"] == source_digest(made["source"])
        and manifest["source"]["format"] == "gguf"
    )
    assert manifest["tensors"]["layers.0.attn.q_proj.weight"] == {
        "kind": "int4",
        "group_size": 32,
        "shape": [64, 64],
    }
    assert manifest["tensors"]["embed_tokens.weight"]["kind"] == "int8"
    assert manifest["tensors"]["norm.weight"] == {
        "kind": "float",
        "dtype": "float32",
        "shape": [64],
    }
    checkpoint = open_checkpoint(made["int4"])
    assert checkpoint.format == "rebar-quant"
    assert checkpoint.tensors["layers.0.mlp.up_proj.weight"].storage == "int4 g32"
    assert checkpoint.tensors["lm_head.weight"].storage == "int8 per-channel"
    assert checkpoint.metadata["quant.method"] == "int4-rtn"
    assert checkpoint.metadata["quant.source.sha256"] == manifest["source"]["sha256"]


def test_tokenizer_and_template_survive(made: dict) -> None:
    original, quantized = open_checkpoint(made["source"]), open_checkpoint(made["int8"])
    for text in ["the and then", "<|im_start|>user\nhi<|im_end|>", "é ünïcode"]:
        assert quantized.tokenizer.encode(text) == original.tokenizer.encode(text)
    assert quantized.chat_template == TEMPLATE
    assert quantized.tokenizer.special == original.tokenizer.special


def mapped_file(tensor: torch.Tensor) -> str | None:
    """The path of the mapping that holds `tensor`'s data, from /proc/self/maps ("[heap]", a file,
    or None)."""
    address = tensor.data_ptr()
    with open("/proc/self/maps", encoding="ascii") as maps:
        for line in maps:
            fields = line.split()
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if start <= address < end:
                return fields[5] if len(fields) > 5 else None
    return None


@requires(need_linux_proc)
def test_weights_are_memory_mapped(made: dict) -> None:
    weight = open_checkpoint(made["int8"]).load_quantized("layers.0.mlp.up_proj.weight")
    assert mapped_file(weight.qweight) == str(made["int8"] / "model.safetensors")
    assert mapped_file(torch.zeros(1000)) != str(made["int8"] / "model.safetensors")


@requires(need_linux_proc)
def test_each_file_is_mapped_once_for_all_its_tensors(made: dict, tmp_path: Path) -> None:
    folder = copy_checkpoint(made["int4"], tmp_path / "c")  # a path no other test has mapped
    checkpoint = open_checkpoint(folder)
    weights = [checkpoint.load_quantized(name) for name in checkpoint.tensors]
    weights = [w for w in weights if w is not None]
    path = str(folder / "model.safetensors")
    with open("/proc/self/maps", encoding="ascii") as maps:
        mappings = [line for line in maps if line.rstrip().endswith(path)]
    assert len(mappings) == 1, len(mappings)
    assert len(weights) > 10 and all(mapped_file(w.scales) == path for w in weights)


def test_shards(made: dict, tmp_path: Path) -> None:
    checkpoint = open_checkpoint(made["int4"])
    tensors = {
        name: checkpoint.load_quantized(name) or checkpoint.load_tensor(name, torch.float32)
        for name in checkpoint.tensors
    }
    header = {
        k: v
        for k, v in json.loads((made["int4"] / MANIFEST_NAME).read_text()).items()
        if k in ("method", "bits", "group_size", "tool", "source", "calibration")
    }
    write_checkpoint(
        tmp_path / "sharded",
        tensors,
        checkpoint.config,
        checkpoint.tokenizer,
        checkpoint.chat_template,
        header,
        max_shard_bytes=20_000,
    )
    files = sorted(p.name for p in (tmp_path / "sharded").glob("*.safetensors"))
    assert len(files) > 3 and files[0].startswith("model-00001-of-")
    torch.testing.assert_close(
        LLM(model=tmp_path / "sharded", device="cpu").logits(IDS),
        LLM(model=made["int4"], device="cpu").logits(IDS),
        rtol=0,
        atol=0,
    )


# ----- damaged checkpoints -----------------------------------------------------------------------


def copy_checkpoint(source: Path, target: Path) -> Path:
    target.mkdir()
    for path in source.iterdir():
        (target / path.name).write_bytes(path.read_bytes())
    return target


def edit_tensors(folder: Path, edit) -> None:
    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, folder / "model.safetensors")


def edit_manifest(folder: Path, edit) -> None:
    manifest = json.loads((folder / MANIFEST_NAME).read_text())
    edit(manifest)
    (folder / MANIFEST_NAME).write_text(json.dumps(manifest))


def test_missing_scales_are_named(made: dict, tmp_path: Path) -> None:
    folder = copy_checkpoint(made["int4"], tmp_path / "c")
    edit_tensors(folder, lambda t: t.pop("layers.1.mlp.up_proj.weight.scales"))
    with pytest.raises(
        ModelFormatError,
        match=r"tensor 'layers\.1\.mlp\.up_proj\.weight\.scales' is missing .*int4 with group size 32",
    ):
        LLM(model=folder, device="cpu")


def test_manifest_saying_int4_over_int8_tensors_is_named(made: dict, tmp_path: Path) -> None:
    folder = copy_checkpoint(made["int8"], tmp_path / "c")
    edit_manifest(
        folder,
        lambda m: m["tensors"]["layers.0.attn.v_proj.weight"].update(kind="int4", group_size=32),
    )
    with pytest.raises(
        ModelFormatError,
        match=r"tensor 'layers\.0\.attn\.v_proj\.weight\.qweight' is I8 \[32, 64\].*needs U8 \[32, 32\]",
    ):
        open_checkpoint(folder)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda t: t.update(
                {"layers.0.attn.q_proj.weight.scales": torch.zeros(64, 3, dtype=torch.float16)}
            ),
            r"'layers\.0\.attn\.q_proj\.weight\.scales' is F16 \[64, 3\]",
        ),
        (
            lambda t: t.update(
                {"layers.0.attn.q_proj.weight.offsets": torch.zeros(64, 2, dtype=torch.float32)}
            ),
            r"'layers\.0\.attn\.q_proj\.weight\.offsets' is F32",
        ),
        (lambda t: t.update({"stray": torch.zeros(2)}), r"tensor 'stray' is not in the manifest"),
        (lambda t: t.pop("norm.weight"), r"tensor 'norm\.weight' is missing"),
    ],
    ids=["scales-shape", "offsets-dtype", "extra", "float-missing"],
)
def test_tensors_that_disagree_with_the_manifest_are_named(
    made: dict, tmp_path: Path, edit, message: str
) -> None:
    folder = copy_checkpoint(made["int4"], tmp_path / "c")
    edit_tensors(folder, edit)
    with pytest.raises(ModelFormatError, match=message):
        load_quantized_checkpoint(folder)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda m: m.update(format_version=2), "format_version 2 is not supported"),
        (lambda m: m.pop("tensors"), "missing the key 'tensors'"),
        (lambda m: m.update(format="other"), "not a rebar-quant manifest"),
        (
            lambda m: m["tensors"]["layers.0.attn.q_proj.weight"].update(group_size=48),
            r"'layers\.0\.attn\.q_proj\.weight' has group size 48",
        ),
        (lambda m: m["tensors"]["layers.0.attn.q_proj.weight"].update(kind="int3"), "malformed"),
        (lambda m: m["config"].update(num_kv_heads=3), "invalid model config"),
        (
            lambda m: m["files"].append("model-2.safetensors"),
            "names model-2.safetensors, which is missing",
        ),
        (lambda m: m.update(config=[1, 2]), "'config' .* must be JSON objects"),
        (lambda m: m["config"].update(rope_scaling="linear"), "'config' .* must be JSON objects"),
    ],
    ids=[
        "version",
        "no-tensors",
        "format",
        "group-size",
        "kind",
        "config",
        "missing-file",
        "config-list",
        "scaling-string",
    ],
)
def test_bad_manifests_are_format_errors(made: dict, tmp_path: Path, edit, message: str) -> None:
    folder = copy_checkpoint(made["int4"], tmp_path / "c")
    edit_manifest(folder, edit)
    with pytest.raises(ModelFormatError, match=message):
        open_checkpoint(folder)


def test_unreadable_manifest_and_truncated_weights(made: dict, tmp_path: Path) -> None:
    folder = copy_checkpoint(made["int4"], tmp_path / "c")
    (folder / MANIFEST_NAME).write_text("{not json")
    with pytest.raises(ModelFormatError, match="not a readable JSON manifest"):
        open_checkpoint(folder)
    folder = copy_checkpoint(made["int4"], tmp_path / "d")
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelFormatError, match="truncated or corrupt"):
        open_checkpoint(folder)


def test_quantized_tensor_of_the_wrong_shape_for_the_model_is_named(
    made: dict, tmp_path: Path
) -> None:
    """Internally consistent, but not the shape the model config implies: build_model names it."""
    folder = copy_checkpoint(made["int8"], tmp_path / "c")

    def shrink(tensors: dict) -> None:
        tensors["layers.0.mlp.up_proj.weight.qweight"] = tensors[
            "layers.0.mlp.up_proj.weight.qweight"
        ][:64].clone()
        tensors["layers.0.mlp.up_proj.weight.scales"] = tensors[
            "layers.0.mlp.up_proj.weight.scales"
        ][:64].clone()

    edit_tensors(folder, shrink)
    edit_manifest(
        folder, lambda m: m["tensors"]["layers.0.mlp.up_proj.weight"].update(shape=[64, 64])
    )
    with pytest.raises(
        ModelFormatError, match=r"layers\.0\.mlp\.up_proj\.weight.*\[64, 64\].*expected \[128, 64\]"
    ):
        LLM(model=folder, device="cpu")
