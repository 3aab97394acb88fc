"""GGUF loading checked against independent references.

Decoders are compared with the `gguf` package's numpy reference, whole tiny models with Hugging Face
`transformers` run on the same weights, and error handling with files broken on purpose. Every GGUF
file is written here by `gguf.GGUFWriter` (see gguf_builder.py).
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGUFReader, GGUFValueType, GGUFWriter, quants
from gguf import GGMLQuantizationType as QT
from gguf_builder import (
    GGUFContents,
    Tensor,
    TinyConfig,
    byte_level_vocab,
    encode,
    model_contents,
    random_hf_state,
    storage_type,
    stored_values,
)

from clock import elapsed_s, reference_s
from expect import raises
from float_reference import float_llm
from markers import need_smollm2
from needs import need_module
from rebar.engine.prompt import prompt_token_ids
from rebar.errors import ModelFormatError, ModelNotFoundError, UnsupportedModelError
from rebar.llm import LLM
from rebar.model.loader import open_checkpoint
from rebar.model.loader.ggml_dequant import SUPPORTED_TYPES, dequantize
from rebar.model.loader.gguf_reader import GGUFFile
from rebar.model.resolve import resolve_model_path

# Types gguf can quantize, and the fp16 fields (byte offsets in a block) of every block type.
QUANTIZABLE = [QT.F32, QT.F16, QT.BF16, QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1]
FP16_FIELDS = {
    QT.Q8_0: (0,),
    QT.Q4_0: (0,),
    QT.Q4_1: (0, 2),
    QT.Q5_0: (0,),
    QT.Q5_1: (0, 2),
    QT.Q4_K: (0, 2),
    QT.Q5_K: (0, 2),
    QT.Q6_K: (208,),
}
TORCH_DECODED = [QT.Q8_0, QT.Q4_0, QT.Q4_1]
IDS = [3, 45, 267, 101, 32, 7, 200, 255, 0, 119, 76, 150, 33, 260, 88, 9, 17, 240, 64, 5, 111]


def type_id(qtype: QT) -> str:
    return qtype.name


def random_blocks(qtype: QT, rows: int, blocks_per_row: int, seed: int = 0) -> np.ndarray:
    """Random raw bytes for `rows` rows of `qtype` blocks, with finite fp16 scales: [rows, row
    bytes] uint8."""
    rng = np.random.default_rng(seed)
    _, type_size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, blocks_per_row, type_size), dtype=np.uint8)
    for offset in FP16_FIELDS[qtype]:
        scales = (rng.standard_normal((rows, blocks_per_row)) * 0.05).astype(np.float16)
        raw[..., offset : offset + 2] = scales.view(np.uint8).reshape(rows, blocks_per_row, 2)
    return raw.reshape(rows, -1)


# ----- dequantization ----------------------------------------------------------------------------


def test_every_supported_type_is_tested_here() -> None:
    """The parametrised decoder tests below cover exactly the types rebar claims to decode."""
    assert set(QUANTIZABLE) | set(FP16_FIELDS) == SUPPORTED_TYPES


@pytest.mark.parametrize("qtype", QUANTIZABLE, ids=type_id)
def test_dequantize_matches_gguf_on_quantized_data(qtype: QT) -> None:
    """Data quantized by gguf decodes to exactly gguf's own values, as float32 [rows, cols]."""
    values = (np.random.default_rng(1).standard_normal((6, 96)) * 3).astype(np.float32)
    got = dequantize(encode(values, qtype), qtype, torch.float32)
    assert got.dtype == torch.float32 and tuple(got.shape) == (6, 96)
    expected = torch.from_numpy(stored_values(values, qtype))
    assert torch.equal(got, expected)
    if qtype != QT.F32:
        assert not torch.equal(got, torch.from_numpy(values)), (
            "the round trip should lose precision"
        )


@pytest.mark.parametrize("qtype", list(FP16_FIELDS), ids=type_id)
def test_dequantize_matches_gguf_on_random_blocks(qtype: QT) -> None:
    """Arbitrary block bytes (every nibble, sign and high bit) decode exactly as gguf decodes them."""
    block_size, _ = GGML_QUANT_SIZES[qtype]
    raw = random_blocks(qtype, rows=5, blocks_per_row=3)
    got = dequantize(raw, qtype, torch.float32)
    assert tuple(got.shape) == (5, 3 * block_size)
    assert torch.equal(got, torch.from_numpy(quants.dequantize(raw, qtype)))


@pytest.mark.parametrize("qtype", TORCH_DECODED, ids=type_id)
def test_dequantize_one_dimensional_blocks(qtype: QT) -> None:
    """A 1-D quantized tensor (bytes only, no row axis) decodes to a 1-D tensor."""
    raw = random_blocks(qtype, rows=1, blocks_per_row=4)[0]
    got = dequantize(raw, qtype, torch.float32)
    assert tuple(got.shape) == (128,)
    assert torch.equal(got, torch.from_numpy(quants.dequantize(raw, qtype)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("qtype", [QT.F32, QT.F16, QT.BF16, QT.Q8_0, QT.Q4_1, QT.Q6_K], ids=type_id)
def test_dequantize_into_requested_dtype(qtype: QT, dtype: torch.dtype) -> None:
    """A half-precision request returns that dtype, holding the float32 decoding rounded once."""
    if qtype in FP16_FIELDS:
        data = random_blocks(qtype, rows=2, blocks_per_row=1)
    else:
        data = encode(np.random.default_rng(2).standard_normal((2, 64)).astype(np.float32), qtype)
    got = dequantize(data, qtype, dtype)
    assert got.dtype == dtype
    assert torch.equal(got, dequantize(data, qtype, torch.float32).to(dtype))


def test_dequantize_copies_out_of_the_source() -> None:
    """The decoded tensor never aliases the (memory-mapped, read-only) source bytes."""
    source = np.arange(64, dtype=np.float32).reshape(2, 32)
    source.flags.writeable = False
    got = dequantize(source, QT.F32, torch.float32)
    got += 1
    assert source[0, 0] == 0


def test_dequantize_rejects_unsupported_type() -> None:
    with pytest.raises(ValueError, match="Q2_K"):
        dequantize(np.zeros((1, 84), np.uint8), QT.Q2_K, torch.float32)


# ----- the header reader -------------------------------------------------------------------------


def mixed_tensors() -> dict[str, Tensor]:
    """One tensor of every supported type, in shapes that leave the data unaligned between tensors."""
    rng = np.random.default_rng(3)
    tensors: dict[str, Tensor] = {}
    for qtype, shape in [(QT.F32, (7,)), (QT.F16, (3, 5)), (QT.BF16, (2, 7)), (QT.F32, (2, 3, 4))]:
        tensors[f"{qtype.name}.{len(shape)}d"] = Tensor(
            encode(rng.standard_normal(shape).astype(np.float32), qtype), qtype
        )
    for qtype in QUANTIZABLE[3:]:
        values = rng.standard_normal((3, 64)).astype(np.float32)
        tensors[qtype.name] = Tensor(encode(values, qtype), qtype)
    for index, qtype in enumerate(FP16_FIELDS):
        tensors[f"raw.{qtype.name}"] = Tensor(
            random_blocks(qtype, rows=index % 3 + 1, blocks_per_row=2, seed=index), qtype
        )
    return tensors


def reference_values(tensor: Tensor) -> np.ndarray:
    if tensor.qtype in (QT.F32, QT.F16):
        return tensor.data.astype(np.float32)
    return quants.dequantize(tensor.data, tensor.qtype)


@pytest.mark.parametrize("alignment", [None, 64, 256])
def test_reader_finds_every_tensor(tmp_path: Path, alignment: int | None) -> None:
    """Shapes, types, offsets and sizes of tensors of every type, at default and custom alignment."""
    tensors = mixed_tensors()
    path = GGUFContents("test", {"test.note": "mixed"}, tensors, alignment).write(
        tmp_path / "mixed.gguf"
    )
    gguf = GGUFFile(path)
    assert list(gguf.tensors) == list(tensors)
    for name, written in tensors.items():
        found = gguf.tensors[name]
        expected = reference_values(written)
        assert found.qtype == written.qtype
        assert found.shape == expected.shape, name
        assert found.num_bytes == written.data.nbytes, name
        assert found.offset % (alignment or 32) == 0
        got = dequantize(found.data(gguf.buffer), found.qtype, torch.float32)
        assert torch.equal(got, torch.from_numpy(expected)), name
    official = GGUFReader(path)
    assert {t.name: int(t.data_offset) for t in official.tensors} == {
        n: t.offset for n, t in gguf.tensors.items()
    }


def test_reader_parses_every_metadata_type(tmp_path: Path) -> None:
    """Every GGUF value type, arrays (of strings, of 64-bit ints, nested) and UTF-8 strings read
    back as written."""
    V = GGUFValueType
    values = {
        "t.u8": (200, V.UINT8),
        "t.i8": (-100, V.INT8),
        "t.u16": (60000, V.UINT16),
        "t.i16": (-30000, V.INT16),
        "t.u32": (4_000_000_000, V.UINT32),
        "t.i32": (-2_000_000_000, V.INT32),
        "t.f32": (0.1, V.FLOAT32),
        "t.bool": (True, V.BOOL),
        "t.str": ("naïve ✓ 🎉", V.STRING),
        "t.u64": (2**63 + 5, V.UINT64),
        "t.i64": (-(2**62), V.INT64),
        "t.f64": (0.1, V.FLOAT64),
    }
    writer = GGUFWriter(tmp_path / "meta.gguf", "test")
    for key, (value, vtype) in values.items():
        writer.add_key_value(key, value, vtype)
    writer.add_key_value("t.strings", ["a", "", "é"], V.ARRAY)
    writer.add_key_value("t.u64s", [1, 2**40], V.ARRAY, sub_type=V.UINT64)
    writer.add_key_value("t.floats", [0.5, -2.0], V.ARRAY, sub_type=V.FLOAT32)
    writer.add_key_value("t.nested", [[1, 2], [3]], V.ARRAY)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    meta = GGUFFile(tmp_path / "meta.gguf").metadata
    for key, (value, vtype) in values.items():
        expected = struct.unpack("<f", struct.pack("<f", value))[0] if vtype == V.FLOAT32 else value
        assert meta[key] == expected and type(meta[key]) is type(expected), key
    assert meta["t.strings"] == ["a", "", "é"]
    assert meta["t.u64s"] == [1, 2**40]
    assert meta["t.floats"] == [0.5, -2.0]
    assert meta["t.nested"] == [[1, 2], [3]]
    assert meta["general.architecture"] == "test"


# ----- whole models against transformers ---------------------------------------------------------


def hf_logits(cfg: TinyConfig, state: dict[str, np.ndarray], ids: list[int]) -> torch.Tensor:
    """Logits of the transformers model with `state` as its weights."""
    transformers = need_module("transformers")
    model_class = (
        transformers.Qwen2ForCausalLM if cfg.arch == "qwen2" else transformers.LlamaForCausalLM
    )
    model = model_class(cfg.hf_config()).eval()
    missing, unexpected = model.load_state_dict(
        {k: torch.from_numpy(v) for k, v in state.items()}, strict=False
    )
    assert not unexpected and set(missing) <= ({"lm_head.weight"} if cfg.tied else set())
    if cfg.tied:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def as_stored(state: dict[str, np.ndarray], storage: QT) -> dict[str, np.ndarray]:
    """The weights a correct loader reads back from a file written with `storage`."""
    return {
        name: stored_values(values, storage_type(values, storage)) for name, values in state.items()
    }


def rebar_logits(path: Path, ids: list[int]) -> torch.Tensor:
    """The float reference path (weights expanded to float32, float32 KV cache)."""
    llm = float_llm(path)
    logits = llm.logits(ids)
    assert logits.dtype == torch.float32 and tuple(logits.shape) == (
        len(ids),
        llm.config.vocab_size,
    )
    return logits


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("storage", [QT.F32, QT.F16, QT.Q8_0], ids=type_id)
def test_llama_gguf_logits_match_transformers(tmp_path: Path, storage: QT, tied: bool) -> None:
    """A converter-style `llama` GGUF (permuted Q/K, GQA) gives the HF model's logits on the stored
    weights."""
    cfg = TinyConfig(arch="llama", tied=tied)
    state = random_hf_state(cfg, seed=10)
    path = model_contents(cfg, state, storage).write(tmp_path / "tiny-llama.gguf")
    got = rebar_logits(path, IDS)
    expected = hf_logits(cfg, as_stored(state, storage), IDS)
    assert expected.abs().max() > 1.0
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
    checkpoint = open_checkpoint(path)
    assert checkpoint.config.tie_word_embeddings is tied
    assert checkpoint.config.source_architecture == "gguf:llama"
    assert checkpoint.tensors["layers.0.attn.q_proj.weight"].storage == storage.name
    assert checkpoint.tensors["layers.0.input_norm.weight"].storage == "F32"


@pytest.mark.parametrize(
    ("storage", "tied"), [(QT.F32, False), (QT.Q8_0, True)], ids=["F32-untied", "Q8_0-tied"]
)
def test_qwen2_gguf_logits_match_transformers(tmp_path: Path, storage: QT, tied: bool) -> None:
    """A `qwen2` GGUF (Q/K not permuted, q/k/v biases) gives HF Qwen2's logits on the stored
    weights."""
    cfg = TinyConfig(arch="qwen2", tied=tied)
    state = random_hf_state(cfg, seed=11)
    path = model_contents(cfg, state, storage).write(tmp_path / "tiny-qwen2.gguf")
    got = rebar_logits(path, IDS)
    expected = hf_logits(cfg, as_stored(state, storage), IDS)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
    config = open_checkpoint(path).config
    assert config.qkv_bias and not config.o_bias


REBAR_NAMES = {
    "self_attn.q_proj": "attn.q_proj",
    "self_attn.k_proj": "attn.k_proj",
    "self_attn.v_proj": "attn.v_proj",
    "self_attn.o_proj": "attn.o_proj",
    "input_layernorm": "input_norm",
    "post_attention_layernorm": "post_attn_norm",
}


def rebar_name(hf_name: str) -> str:
    name = hf_name.removeprefix("model.")
    for hf_part, rebar_part in REBAR_NAMES.items():
        name = name.replace(hf_part, rebar_part)
    return name


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_loaded_tensors_equal_hf_weights(tmp_path: Path, arch: str) -> None:
    """Each tensor rebar loads from an F32 file is bit-identical to the HF weight it came from."""
    cfg = TinyConfig(arch=arch)
    state = random_hf_state(cfg, seed=12)
    checkpoint = open_checkpoint(model_contents(cfg, state).write(tmp_path / f"{arch}.gguf"))
    assert set(checkpoint.tensors) == {rebar_name(n) for n in state}
    for hf_name, values in state.items():
        loaded = checkpoint.load_tensor(rebar_name(hf_name), torch.float32)
        assert torch.equal(loaded, torch.from_numpy(values)), hf_name


def test_llama_file_without_permutation_does_not_match(tmp_path: Path) -> None:
    """The Q/K un-permutation matters: the same weights written unpermuted give different logits."""
    cfg = TinyConfig(arch="llama")
    state = random_hf_state(cfg, seed=13)
    expected = hf_logits(cfg, state, IDS)
    right = model_contents(cfg, state, permute_qk=True).write(tmp_path / "permuted.gguf")
    wrong = model_contents(cfg, state, permute_qk=False).write(tmp_path / "unpermuted.gguf")
    torch.testing.assert_close(rebar_logits(right, IDS), expected, atol=1e-4, rtol=0)
    assert (rebar_logits(wrong, IDS) - expected).abs().max() > 1e-2


# ----- tokenizer from metadata -------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A valid F32 tiny `llama` GGUF; tests copy it before breaking it."""
    return model_contents(TinyConfig()).write(tmp_path_factory.mktemp("tiny") / "tiny.gguf")


def copy_of(source: Path, tmp_path: Path, name: str = "copy.gguf") -> Path:
    target = tmp_path / name
    target.write_bytes(source.read_bytes())
    return target


def test_special_tokens_in_text_are_single_ids(tiny_llama: Path) -> None:
    """Control tokens written in text encode to their own id and are marked special; BOS/EOS come
    from metadata."""
    tokenizer = open_checkpoint(tiny_llama).tokenizer
    vocab = byte_level_vocab()
    ids = tokenizer.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == vocab.id("<|im_start|>") and ids[-1] == vocab.id("<|im_end|>")
    assert ids[1:-1] == tokenizer.encode("user\nhi")
    assert tokenizer.is_special(ids[0]) and not any(tokenizer.is_special(i) for i in ids[1:-1])
    assert tokenizer.vocab_size == len(vocab.tokens)
    # generation ends at EOS and, as in llama.cpp, at ChatML's end of turn though the file names
    # only EOS
    assert tokenizer.special.bos_token_id == vocab.bos_id
    assert tokenizer.special.eos_token_ids == (vocab.eos_id, vocab.id("<|im_end|>"))
    assert tokenizer.special.eos_token == "<|endoftext|>" and not tokenizer.special.add_bos


def test_end_of_turn_ids_from_the_metadata_end_generation(tmp_path: Path) -> None:
    """`tokenizer.ggml.eot_token_id` / `eom_token_id` end generation too, after EOS, each once."""
    contents = model_contents(TinyConfig())
    vocab = byte_level_vocab()
    contents.metadata["tokenizer.ggml.eot_token_id"] = vocab.id("<|im_start|>")
    contents.metadata["tokenizer.ggml.eom_token_id"] = vocab.eos_id
    tokenizer = open_checkpoint(contents.write(tmp_path / "eot.gguf")).tokenizer
    assert tokenizer.special.eos_token_ids == (
        vocab.eos_id,
        vocab.id("<|im_start|>"),
        vocab.id("<|im_end|>"),
    )


def test_add_bos_flag_is_read(tmp_path: Path) -> None:
    """`tokenizer.ggml.add_bos_token` decides whether text prompts start with BOS."""
    contents = model_contents(TinyConfig())
    contents.metadata["tokenizer.ggml.add_bos_token"] = True
    llm = LLM(model=contents.write(tmp_path / "bos.gguf"), dtype="float32", device="cpu")
    assert llm.tokenizer.special.add_bos
    assert prompt_token_ids(llm.tokenizer, "hi") == [byte_level_vocab().bos_id, *llm.tokenize("hi")]


def test_merges_are_applied_in_rank_order(tiny_llama: Path) -> None:
    """Merges from metadata build multi-byte tokens; pairs with no merge stay apart."""
    tokenizer = open_checkpoint(tiny_llama).tokenizer
    vocab = byte_level_vocab()
    assert tokenizer.encode(" the") == [vocab.id("Ġthe")]
    assert tokenizer.encode(" and") == [vocab.id("Ġand")]
    assert tokenizer.encode("the") == [vocab.id("t"), vocab.id("he")]


@pytest.mark.parametrize(
    "text",
    [
        "Hello, world! 123",
        "café naïve Ærøskøbing",
        "emoji 🎉👍🏽 and 漢字",
        "tabs\tand\n\nnewlines  ",
        " the and ",
    ],
)
def test_decode_inverts_encode(tiny_llama: Path, text: str) -> None:
    """Byte-level BPE round-trips ASCII, accented letters, CJK and emoji exactly."""
    tokenizer = open_checkpoint(tiny_llama).tokenizer
    ids = tokenizer.encode(text)
    assert all(0 <= i < tokenizer.vocab_size for i in ids)
    assert tokenizer.decode(ids) == text


@pytest.mark.parametrize(
    ("key", "value"),
    [("tokenizer.ggml.model", "rwkv"), ("tokenizer.ggml.pre", "mystery-pre")],
    ids=["model", "pre"],
)
def test_unsupported_tokenizer_is_named(tmp_path: Path, key: str, value: str) -> None:
    """An unknown tokenizer model or pre-tokenizer is refused, naming it."""
    contents = model_contents(TinyConfig(arch="qwen2"))
    contents.metadata[key] = value
    path = contents.write(tmp_path / "tok.gguf")
    raises(UnsupportedModelError, lambda: open_checkpoint(path), repr(value))


def test_sentencepiece_vocabulary_without_scores_is_a_format_error(tmp_path: Path) -> None:
    """A 'llama' (SentencePiece) vocabulary is ranked by its scores; without them it is refused."""
    contents = model_contents(TinyConfig(arch="qwen2"))
    contents.metadata["tokenizer.ggml.model"] = "llama"
    contents.metadata.pop("tokenizer.ggml.scores", None)
    path = contents.write(tmp_path / "tok.gguf")
    raises(ModelFormatError, lambda: open_checkpoint(path), "score")


# ----- errors ------------------------------------------------------------------------------------


@pytest.mark.parametrize("which", [0, 10, -1], ids=["first", "middle", "last"])
def test_truncated_tensor_data_names_the_tensor(
    tiny_llama: Path, tmp_path: Path, which: int
) -> None:
    """A file cut inside a tensor's data is a ModelFormatError naming that tensor."""
    tensor = sorted(GGUFReader(tiny_llama).tensors, key=lambda t: int(t.data_offset))[which]
    path = copy_of(tiny_llama, tmp_path)
    path.write_bytes(path.read_bytes()[: int(tensor.data_offset) + int(tensor.n_bytes) // 2])
    raises(ModelFormatError, lambda: open_checkpoint(path), repr(tensor.name), "truncated")


@pytest.mark.parametrize("fraction", [0.0, 0.1, 0.5, 0.9, 0.999])
def test_truncated_header_is_a_format_error(
    tiny_llama: Path, tmp_path: Path, fraction: float
) -> None:
    """A file cut inside the header (counts, metadata, tensor index) is a ModelFormatError."""
    header_bytes = GGUFReader(tiny_llama).data_offset
    cut = 6 + int((header_bytes - 6) * fraction)
    path = copy_of(tiny_llama, tmp_path)
    path.write_bytes(path.read_bytes()[:cut])
    raises(ModelFormatError, lambda: open_checkpoint(path), "truncated", str(path))


def test_bad_magic(tiny_llama: Path, tmp_path: Path) -> None:
    path = copy_of(tiny_llama, tmp_path)
    path.write_bytes(b"GGML" + path.read_bytes()[4:])
    raises(ModelFormatError, lambda: open_checkpoint(path), "not a GGUF", str(path))


@pytest.mark.parametrize(
    "content", [b"", b"GG", b'{"not": "gguf"}'], ids=["empty", "two-bytes", "json"]
)
def test_not_a_gguf_file(tmp_path: Path, content: bytes) -> None:
    """Empty, tiny and foreign files named .gguf are ModelFormatErrors naming the path."""
    path = tmp_path / "bogus.gguf"
    path.write_bytes(content)
    raises(ModelFormatError, lambda: open_checkpoint(path), str(path))


@pytest.mark.parametrize("version", [1, 4])
def test_unsupported_gguf_version(tiny_llama: Path, tmp_path: Path, version: int) -> None:
    path = copy_of(tiny_llama, tmp_path)
    data = bytearray(path.read_bytes())
    struct.pack_into("<I", data, 4, version)
    path.write_bytes(bytes(data))
    raises(UnsupportedModelError, lambda: open_checkpoint(path), f"version {version}")


@pytest.mark.parametrize("arch", ["falcon", "mamba"])
def test_unsupported_architecture_is_named(tmp_path: Path, arch: str) -> None:
    """A family rebar does not run names itself and the families rebar does run."""
    contents = model_contents(TinyConfig())
    contents.arch = arch
    path = contents.write(tmp_path / f"{arch}.gguf")
    raises(
        UnsupportedModelError,
        lambda: open_checkpoint(path),
        repr(arch),
        "gemma3",
        "qwen3",
        "phi3",
        "llama",
    )


@pytest.mark.parametrize("qtype", [QT.Q2_K, QT.Q3_K, QT.IQ4_NL, QT.IQ4_XS, QT.Q8_1], ids=type_id)
def test_unsupported_tensor_type_is_named(tmp_path: Path, qtype: QT) -> None:
    """A tensor in a GGML type rebar cannot decode is refused at open, naming tensor and type."""
    cfg = TinyConfig(hidden=256)
    contents = model_contents(cfg)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    raw = np.zeros((cfg.intermediate, cfg.hidden // block_size * type_size), np.uint8)
    contents.tensors["blk.1.ffn_gate.weight"] = Tensor(raw, qtype)
    path = contents.write(tmp_path / "odd-type.gguf")
    message = raises(
        UnsupportedModelError, lambda: open_checkpoint(path), "'blk.1.ffn_gate.weight'", qtype.name
    )
    # ... and says what rebar runs and what to do
    assert "Q4_K" in message and "Q6_K" in message and "llama-quantize" in message


def test_block_type_on_a_norm_is_named(tmp_path: Path) -> None:
    """Block-quantized types hold 2-D weights: a norm stored as Q8_0 is a ModelFormatError naming
    it."""
    contents = model_contents(TinyConfig())
    contents.tensors["blk.0.attn_norm.weight"] = Tensor(
        encode(np.ones(64, np.float32), QT.Q8_0), QT.Q8_0
    )
    path = contents.write(tmp_path / "quantized-norm.gguf")
    raises(
        ModelFormatError, lambda: open_checkpoint(path), "'blk.0.attn_norm.weight'", "Q8_0", "2-D"
    )


def mapped_resident_kib(path: Path) -> int:
    """Resident KiB of this process's mapping of `path`."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.endswith(str(path)))
    return int(next(line for line in lines[start:] if line.startswith("Rss:")).split()[1])


def test_released_tensor_pages_leave_resident_memory(tmp_path: Path) -> None:
    """GGUFFile.release drops a tensor's pages from the process's resident set (the build releases
    each weight once it is repacked, so a load never holds the file and its repacked copy at
    once)."""
    cfg = TinyConfig(hidden=256, intermediate=4096)
    path = model_contents(cfg, random_hf_state(cfg, seed=1), QT.Q8_0).write(tmp_path / "big.gguf")
    gguf = GGUFFile(path)

    def resident_kib() -> int:
        return mapped_resident_kib(path)

    tensors = list(gguf.tensors.values())
    total = sum(int(gguf.raw_rows(t).sum()) for t in tensors)  # touch every page
    assert total > 0 and resident_kib() > path.stat().st_size // 1024 // 2
    for tensor in tensors:
        gguf.release(tensor)
    assert resident_kib() < 64, "released pages still resident"
    assert int(gguf.raw_rows(tensors[3]).sum()) == int(
        torch.from_numpy(np.array(tensors[3].data(gguf.buffer))).sum()
    )


def test_packing_a_mapped_weight_releases_it_chunk_by_chunk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A weight packed for the CPU kernels a chunk of rows at a time gives each chunk's file pages
    back as it goes: a vocabulary-sized embedding never has all its file pages resident beside its
    packed copy (a Gemma 3 load peaked 150 MiB higher without this)."""
    from rebar.weights import qlinear
    from rebar.weights.block_weight import BlockWeight

    rows, cols = 65536, 256  # 17 MiB of Q8_0, packed in 16 chunks
    blocks = np.random.default_rng(0).integers(0, 256, (rows, cols // 32, 34), dtype=np.uint8)
    blocks[..., :2] = (
        np.full((rows, cols // 32), 0.01, np.float16).view(np.uint8).reshape(rows, -1, 2)
    )
    writer = GGUFWriter(str(tmp_path / "one.gguf"), "llama")
    writer.add_tensor("big", blocks.reshape(rows, -1), raw_dtype=QT.Q8_0)
    for write in (
        writer.write_header_to_file,
        writer.write_kv_data_to_file,
        writer.write_tensors_to_file,
    ):
        write()
    writer.close()
    path = tmp_path / "one.gguf"
    gguf = GGUFFile(path)
    tensor = gguf.tensors["big"]
    resident: list[int] = []

    def recording(view: torch.Tensor) -> None:
        resident.append(mapped_resident_kib(path))
        gguf.release_view(view)

    weight = BlockWeight("Q8_0", gguf.raw_rows(tensor), cols, release_pages=recording)
    monkeypatch.setattr(qlinear, "PACK_CHUNK_WEIGHTS", rows // 16 * cols)
    packed = qlinear.pack_for_cpu(weight)
    assert len(resident) == 16
    assert max(resident) < weight.num_bytes // 1024 // 3, "file pages piled up while packing"
    assert torch.equal(
        packed.dequantize(), weight.dequantize()
    )  # pages read back from the page cache
    with pytest.raises(ValueError, match="not part of this file"):
        gguf.release_view(torch.zeros(4, dtype=torch.uint8))


def header_field_offset(path: Path, tensor_name: str) -> tuple[int, int]:
    """Byte offsets of a tensor's first ggml dimension and of its type id in the tensor index."""
    data = path.read_bytes()
    name = tensor_name.encode()
    start = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    (num_dims,) = struct.unpack_from("<I", data, start)
    return start + 4, start + 4 + 8 * num_dims


def test_unknown_type_id_is_named(tiny_llama: Path, tmp_path: Path) -> None:
    """A type id that GGML itself does not know is an UnsupportedModelError naming the tensor and
    id."""
    path = copy_of(tiny_llama, tmp_path)
    data = bytearray(path.read_bytes())
    struct.pack_into("<I", data, header_field_offset(path, "blk.0.ffn_up.weight")[1], 250)
    path.write_bytes(bytes(data))
    raises(UnsupportedModelError, lambda: open_checkpoint(path), "'blk.0.ffn_up.weight'", "250")


def test_dimensions_beyond_the_file_are_a_format_error(tiny_llama: Path, tmp_path: Path) -> None:
    """Dimensions whose product wraps around 64 bits still count as far past the end of the file."""
    path = copy_of(tiny_llama, tmp_path)
    data = bytearray(path.read_bytes())
    dims_at, _ = header_field_offset(path, "blk.0.ffn_up.weight")
    struct.pack_into("<QQ", data, dims_at, 2**31, 2**33)
    path.write_bytes(bytes(data))
    raises(ModelFormatError, lambda: GGUFFile(path), "'blk.0.ffn_up.weight'")


def patched(source: Path, tmp_path: Path, old: bytes, new: bytes) -> Path:
    """A copy of `source` with the first occurrence of `old` replaced by `new` (same length)."""
    assert len(old) == len(new)
    data = source.read_bytes()
    assert old in data
    path = tmp_path / "patched.gguf"
    path.write_bytes(data.replace(old, new, 1))
    return path


def test_duplicate_tensor_name_is_a_format_error(tiny_llama: Path, tmp_path: Path) -> None:
    """Two index entries with one name are refused (as llama.cpp does), not silently merged."""
    path = patched(tiny_llama, tmp_path, b"blk.0.ffn_up.weight", b"blk.1.ffn_up.weight")
    raises(ModelFormatError, lambda: open_checkpoint(path), "'blk.1.ffn_up.weight'", "twice")


def test_duplicate_metadata_key_is_a_format_error(tmp_path: Path) -> None:
    contents = model_contents(TinyConfig())
    contents.metadata["test.key_a"] = 1
    contents.metadata["test.key_b"] = 2
    path = patched(contents.write(tmp_path / "keys.gguf"), tmp_path, b"test.key_b", b"test.key_a")
    raises(ModelFormatError, lambda: open_checkpoint(path), "'test.key_a'", "twice")


def test_unknown_metadata_value_type_is_a_format_error(tiny_llama: Path, tmp_path: Path) -> None:
    key = b"general.architecture"
    data = bytearray(tiny_llama.read_bytes())
    type_at = data.index(struct.pack("<Q", len(key)) + key) + 8 + len(key)
    struct.pack_into("<I", data, type_at, 13)
    path = tmp_path / "vtype.gguf"
    path.write_bytes(bytes(data))
    raises(ModelFormatError, lambda: open_checkpoint(path), "value type 13")


def test_non_utf8_metadata_string_is_a_format_error(tmp_path: Path) -> None:
    contents = model_contents(TinyConfig())
    contents.metadata["general.name"] = "tiny-marker"
    path = patched(
        contents.write(tmp_path / "utf8.gguf"), tmp_path, b"tiny-marker", b"tiny-\xff\xfeaker"
    )
    raises(ModelFormatError, lambda: open_checkpoint(path), "UTF-8")


def test_zero_alignment_is_a_format_error(tmp_path: Path) -> None:
    """A general.alignment of 0 (invalid per the spec) is a ModelFormatError naming the key."""
    contents = model_contents(TinyConfig())
    contents.metadata["general.alignment"] = 0
    path = contents.write(tmp_path / "align0.gguf")
    raises(ModelFormatError, lambda: open_checkpoint(path), "general.alignment")


def test_wrong_tensor_shape_names_tensor_and_shapes(tmp_path: Path) -> None:
    """A tensor whose shape disagrees with the metadata fails the build, naming it and both shapes."""
    cfg = TinyConfig()
    contents = model_contents(cfg)
    values = np.zeros((cfg.intermediate + 1, cfg.hidden), np.float32)
    contents.tensors["blk.0.ffn_up.weight"] = Tensor(values, QT.F32)
    path = contents.write(tmp_path / "shape.gguf")
    raises(
        ModelFormatError,
        lambda: LLM(model=path, dtype="float32", device="cpu"),
        "'blk.0.ffn_up.weight'",
        "[129, 64]",
        "[128, 64]",
    )


def test_missing_tensor_is_named(tmp_path: Path) -> None:
    contents = model_contents(TinyConfig())
    del contents.tensors["blk.1.ffn_down.weight"]
    path = contents.write(tmp_path / "missing.gguf")
    message = raises(
        ModelFormatError, lambda: LLM(model=path, dtype="float32", device="cpu"), "missing"
    )
    assert "blk.1.ffn_down.weight" in message or "layers.1.mlp.down_proj.weight" in message


REQUIRED_KEYS = [
    "llama.block_count",
    "llama.context_length",
    "llama.embedding_length",
    "llama.feed_forward_length",
    "llama.attention.head_count",
    "llama.attention.layer_norm_rms_epsilon",
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.model",
]


@pytest.mark.parametrize("key", [*REQUIRED_KEYS, "general.architecture"])
def test_missing_metadata_key_is_named(tmp_path: Path, key: str) -> None:
    contents = model_contents(TinyConfig())
    if key == "general.architecture":
        contents.arch = None
    else:
        del contents.metadata[key]
    path = contents.write(tmp_path / "nokey.gguf")
    raises(ModelFormatError, lambda: open_checkpoint(path), repr(key))


@pytest.mark.parametrize(
    "name", ["blk.0.attn_qkv.weight", "blk.0.ffn_gate_exps.weight", "mystery.weight"]
)
def test_unknown_tensor_name_is_named(tmp_path: Path, name: str) -> None:
    contents = model_contents(TinyConfig())
    contents.tensors[name] = Tensor(np.zeros((4, 64), np.float32), QT.F32)
    path = contents.write(tmp_path / "extra.gguf")
    raises(UnsupportedModelError, lambda: open_checkpoint(path), repr(name))


def test_nonexistent_path(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere" / "model.gguf"
    raises(ModelNotFoundError, lambda: open_checkpoint(missing), str(missing))


def test_bin_file_is_refused(tmp_path: Path) -> None:
    """A non-GGUF file path points the user at the formats rebar reads."""
    path = tmp_path / "pytorch_model.bin"
    path.write_bytes(b"\x80\x02")
    raises(ModelNotFoundError, lambda: open_checkpoint(path), str(path), "GGUF", "folder")


# ----- the bundled real model --------------------------------------------------------------------


def test_bundled_smollm2_opens_quickly() -> None:
    """The real SmolLM2 Q4_1 GGUF opens (header, vocab, index) fast with the expected config and
    types."""
    try:
        path = resolve_model_path("smollm2")
    except ModelNotFoundError:
        need_smollm2()
    # Time is the point: against a calibration of this machine taken around it (about 4x the
    # reference work here; reading the tensors, ~100 MB, would take well over 25x).
    before = reference_s()
    opened = [elapsed_s(lambda: open_checkpoint(path)) for _ in range(3)]
    checkpoint, elapsed = min(opened, key=lambda pair: pair[1])
    reference = max(before, reference_s())
    assert elapsed < 25 * reference, (
        f"opening took {elapsed:.2f}s, {elapsed / reference:.0f}x the reference"
    )
    config = checkpoint.config
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (
        30,
        9,
        3,
        64,
    )
    assert config.vocab_size == 49152 and config.tie_word_embeddings
    assert checkpoint.tokenizer.vocab_size == 49152
    assert len(checkpoint.tensors) == 30 * 9 + 2
    assert {t.storage for t in checkpoint.tensors.values()} <= {"Q4_1", "Q8_0", "F32"}
    assert checkpoint.tensors["embed_tokens.weight"].shape == (49152, 576)
    assert len(checkpoint.tokenizer.encode("<|im_start|>")) == 1
