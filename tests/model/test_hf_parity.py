"""rebar's model math against Hugging Face `transformers`, on tiny random checkpoints.

Each test builds a random HF model from a seed, saves it as a folder with `save_pretrained`,
loads that folder with rebar and compares outputs with the HF module run in float32. The
models are random, so any wrong weight name, transposition, RoPE detail, mask or pooling rule
shows up as a large difference, not a subtle one.
"""

from __future__ import annotations

import pickle
import re
from pathlib import Path
from typing import Any

import hf_tiny
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from float_reference import float_llm
from needs import need_linux_proc, need_module, requires
from rebar import LLM, SamplingParams
from rebar.errors import ModelFormatError, UnsupportedModelError

need_module("transformers")  # the reference models these tests compare against

LOGIT_ATOL = 1e-4
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
LINEAR_ROPE = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}
DEFAULT_ROPE = {"rope_type": "default", "rope_theta": 10000.0}

# name -> (architecture, config overrides, config.json edit that removes the feature under test or
# None)
DECODER_CASES: dict[str, tuple[str, dict[str, Any], dict[str, Any] | None]] = {
    "llama-mha-untied": ("LlamaForCausalLM", {}, None),
    "llama-gqa-tied": (
        "LlamaForCausalLM",
        {
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "tie_word_embeddings": True,
            "num_hidden_layers": 3,
        },
        None,
    ),
    "llama-attn-mlp-bias": ("LlamaForCausalLM", {"attention_bias": True, "mlp_bias": True}, None),
    "llama-rope-llama3": (
        "LlamaForCausalLM",
        {"rope_parameters": LLAMA3_ROPE},
        {"rope_parameters": DEFAULT_ROPE},
    ),
    "llama-rope-linear": (
        "LlamaForCausalLM",
        {"rope_parameters": LINEAR_ROPE},
        {"rope_parameters": DEFAULT_ROPE},
    ),
    "llama-explicit-head-dim": (
        "LlamaForCausalLM",
        {"head_dim": 24, "num_key_value_heads": 2},
        None,
    ),
    "mistral-sliding-window": (
        "MistralForCausalLM",
        {"sliding_window": 8, "num_key_value_heads": 2},
        {"sliding_window": None},
    ),
    "qwen2-untied": ("Qwen2ForCausalLM", {"num_key_value_heads": 2}, None),
    "qwen2-tied": ("Qwen2ForCausalLM", {"tie_word_embeddings": True}, None),
    "qwen3-qk-norm": ("Qwen3ForCausalLM", {"num_key_value_heads": 2, "head_dim": 32}, None),
    "qwen3-tied": (
        "Qwen3ForCausalLM",
        {"tie_word_embeddings": True, "num_key_value_heads": 1},
        None,
    ),
    # Gemma 3: scaled embedding, GeGLU, four norms per layer (stored as w - 1), q/k norms, a
    # query_pre_attn_scalar of its own, and local sliding-window layers (their own RoPE base)
    # between global ones.
    "gemma3-local-global": (
        "Gemma3ForCausalLM",
        {
            "num_hidden_layers": 4,
            "num_key_value_heads": 1,
            "head_dim": 32,
            "query_pre_attn_scalar": 24,
            "sliding_window": 6,
            "layer_types": [
                "sliding_attention",
                "full_attention",
                "sliding_attention",
                "full_attention",
            ],
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
            },
            "tie_word_embeddings": True,
        },
        None,
    ),
    "phi3-fused": ("Phi3ForCausalLM", {"num_key_value_heads": 2, "sliding_window": None}, None),
    "phi3-window": ("Phi3ForCausalLM", {"sliding_window": 7}, {"sliding_window": None}),
}


def _random_ids(count: int, seed: int, vocab_size: int = 160) -> list[int]:
    """Ordinary token ids (the specials <unk>/<s>/</s> are ids 0-2 and are avoided)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab_size, (count,), generator=generator).tolist()


@torch.no_grad()
def _hf_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0].float()


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, f"shape {tuple(a.shape)} != {tuple(b.shape)}"
    return (a - b).abs().max().item()


def _decoder_folder(
    tmp_path: Path, arch: str, seed: int = 0, **overrides: Any
) -> tuple[torch.nn.Module, Path]:
    model = hf_tiny.build_decoder(arch, seed, **overrides)
    return model, hf_tiny.save_decoder(model, tmp_path / "model")


# ----- decoder logits ---------------------------------------------------------------------


@pytest.mark.parametrize("case", list(DECODER_CASES))
def test_decoder_logits_match_hf(case: str, tmp_path: Path) -> None:
    """Teacher-forced float32 logits equal HF's at every position, for each supported config shape."""
    arch, overrides, _ = DECODER_CASES[case]
    model, folder = _decoder_folder(tmp_path, arch, seed=len(case), **overrides)
    ids = _random_ids(33, seed=1)
    expected = _hf_logits(model, ids)
    assert expected.std() > 0.5, "random model should give varied logits"

    got = float_llm(folder).logits(ids)
    assert got.dtype == torch.float32
    assert _max_diff(got, expected) <= LOGIT_ATOL


@pytest.mark.parametrize(
    "case", [c for c, (_, _, ablation) in DECODER_CASES.items() if ablation is not None]
)
def test_decoder_features_under_test_change_logits(case: str, tmp_path: Path) -> None:
    """The parity cases have teeth: dropping the feature (window, rope scaling) from config.json
    breaks parity.

    Shows that rebar's agreement in those cases comes from reading and applying the feature,
    not from the feature being a no-op at these sizes.
    """
    arch, overrides, ablation = DECODER_CASES[case]
    model, folder = _decoder_folder(tmp_path, arch, seed=len(case), **overrides)
    ids = _random_ids(33, seed=1)
    hf_tiny.edit_config(folder, **ablation)
    got = float_llm(folder).logits(ids)
    assert _max_diff(got, _hf_logits(model, ids)) > 1e-2


@requires(need_linux_proc)
def test_a_float32_folder_is_mapped_once_for_all_its_tensors(tmp_path: Path) -> None:
    """Weights already in float32 are used in place from one mapping of the file, not one per
    tensor."""
    from rebar.model.loader import open_checkpoint

    _, folder = _decoder_folder(tmp_path, "LlamaForCausalLM")
    checkpoint = open_checkpoint(folder)
    tensors = [checkpoint.load_tensor(name, torch.float32) for name in checkpoint.tensors]
    path = str(folder / "model.safetensors")
    with open("/proc/self/maps", encoding="ascii") as maps:
        mappings = [line.split()[0] for line in maps if line.rstrip().endswith(path)]
    assert len(mappings) == 1, len(mappings)
    start, end = (int(x, 16) for x in mappings[0].split("-"))
    assert len(tensors) > 5 and all(start <= t.data_ptr() < end for t in tensors)


def test_transformers_v4_rope_keys_are_read(tmp_path: Path) -> None:
    """A config.json in the transformers 4.x form (rope_theta + rope_scaling) gives the same logits."""
    model, folder = _decoder_folder(
        tmp_path, "LlamaForCausalLM", seed=3, rope_parameters={**LLAMA3_ROPE, "rope_theta": 5000.0}
    )
    v4_scaling = {k: v for k, v in LLAMA3_ROPE.items() if k not in ("rope_type", "rope_theta")}
    hf_tiny.edit_config(
        folder,
        rope_parameters=None,
        rope_theta=5000.0,
        rope_scaling={"rope_type": "llama3", **v4_scaling},
    )
    ids = _random_ids(30, seed=2)
    got = float_llm(folder).logits(ids)
    assert _max_diff(got, _hf_logits(model, ids)) <= LOGIT_ATOL


def test_qwen2_sliding_window_on_every_layer_matches_hf(tmp_path: Path) -> None:
    """Qwen2 with use_sliding_window and every layer windowed (max_window_layers=0) matches HF."""
    model, folder = _decoder_folder(
        tmp_path,
        "Qwen2ForCausalLM",
        seed=4,
        use_sliding_window=True,
        sliding_window=6,
        max_window_layers=0,
    )
    ids = _random_ids(30, seed=3)
    got = float_llm(folder).logits(ids)
    assert _max_diff(got, _hf_logits(model, ids)) <= LOGIT_ATOL


def test_qwen2_mixed_window_layers_match_hf(tmp_path: Path) -> None:
    """Qwen2 whose layers mix windowed and full attention (max_window_layers=1) runs each layer with
    its own pattern, from layer_types (transformers 5) or from max_window_layers alone (4.x)."""
    model, folder = _decoder_folder(
        tmp_path,
        "Qwen2ForCausalLM",
        seed=5,
        use_sliding_window=True,
        sliding_window=6,
        max_window_layers=1,
    )
    ids = _random_ids(30, seed=3)
    expected = _hf_logits(model, ids)
    assert float_llm(folder).config.sliding_layers == (False, True)
    assert _max_diff(float_llm(folder).logits(ids), expected) <= LOGIT_ATOL
    hf_tiny.edit_config(
        folder, layer_types=None
    )  # transformers 4.x form: only max_window_layers says it
    assert _max_diff(float_llm(folder).logits(ids), expected) <= LOGIT_ATOL


# ----- greedy generation through the paged KV cache ---------------------------------------


@torch.no_grad()
def _hf_greedy(model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
    model.generation_config.eos_token_id = None  # like rebar's ignore_eos
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        pad_token_id=0,
    )
    new = out[0, len(prompt) :].tolist()
    assert len(new) == max_new_tokens, "HF stopped early"
    return new


@pytest.mark.parametrize(
    ("arch", "overrides"),
    [
        (
            "LlamaForCausalLM",
            {"num_attention_heads": 8, "num_key_value_heads": 2, "num_hidden_layers": 3},
        ),
        ("MistralForCausalLM", {"sliding_window": 8, "num_key_value_heads": 2}),
    ],
    ids=["llama-gqa", "mistral-sliding-window"],
)
def test_batched_greedy_generation_matches_hf(
    arch: str, overrides: dict[str, Any], tmp_path: Path
) -> None:
    """Greedy decoding of a batch of 3 prompts (lengths straddling KV block edges) equals HF token
    for token.

    rebar prefills the batch together and decodes from its paged KV cache; HF runs each prompt
    alone with its own cache, so this checks the decode path, not only the prefill.
    """
    model, folder = _decoder_folder(tmp_path, arch, seed=7, **overrides)
    prompts = [_random_ids(n, seed=10 + n) for n in (5, 16, 29)]
    llm = float_llm(folder)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    for prompt, output in zip(prompts, outputs):
        assert output.finish_reason == "length"
        assert output.token_ids == _hf_greedy(model, prompt, 10)


# ----- bfloat16 ---------------------------------------------------------------------------


def test_bfloat16_top1_agrees_with_float32_hf(tmp_path: Path) -> None:
    """rebar in bfloat16 picks HF-float32's top token at >= 90% of positions.

    bfloat16 keeps 8 mantissa bits: every matmul and norm rounds at ~0.4% relative, and logits of
    magnitude ~5 drift by up to ~0.2 after two layers, so positions whose two leading logits are
    that close legitimately flip. The bounds are a sanity check that the bf16 path runs the same
    math (a wrong cast, scale or overflow drops agreement towards chance, ~1/vocab, and moves
    logits by whole units), not a precision claim.
    """
    model, folder = _decoder_folder(
        tmp_path, "LlamaForCausalLM", seed=11, num_attention_heads=8, num_key_value_heads=2
    )
    ids = _random_ids(40, seed=4)
    expected = _hf_logits(model, ids)
    llm = LLM(model=str(folder), dtype="bfloat16", device="cpu")
    assert next(llm.model.parameters()).dtype == torch.bfloat16
    got = llm.logits(ids)
    agreement = (got.argmax(-1) == expected.argmax(-1)).float().mean().item()
    assert agreement >= 0.9
    assert _max_diff(got, expected) < 0.5


# ----- BERT embeddings --------------------------------------------------------------------

BERT_TEXTS = [
    "w7",
    "w12 w40 w41 w99 w5 w63",
    "w8 w9 w10 w11 w12 w13 w14 w15 w16 w17 w18 w19 w20",
    "w100 w3, w77! w51",
]


@torch.no_grad()
def _hf_embeddings(
    model: torch.nn.Module, folder: Path, texts: list[str], pooling: str, normalize: bool
) -> torch.Tensor:
    """HF BertModel's last_hidden_state, pooled the sentence-transformers way."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    encoded = [e.ids for e in tokenizer.encode_batch(texts)]
    width = max(len(ids) for ids in encoded)
    input_ids = torch.tensor([ids + [0] * (width - len(ids)) for ids in encoded])
    mask = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids in encoded])
    hidden = model(
        input_ids=input_ids, attention_mask=mask, token_type_ids=torch.zeros_like(input_ids)
    ).last_hidden_state
    if pooling == "cls":
        pooled = hidden[:, 0]
    else:
        weights = mask[:, :, None].float()
        pooled = (hidden * weights).sum(1) / weights.sum(1)
    return F.normalize(pooled, dim=-1) if normalize else pooled


def _assert_embeddings_close(got: torch.Tensor, expected: torch.Tensor) -> None:
    assert got.shape == expected.shape
    assert F.cosine_similarity(got, expected, dim=-1).min().item() >= 0.9999
    assert _max_diff(got, expected) <= 1e-4


@pytest.mark.parametrize(
    ("pooling", "normalize"),
    [("mean", True), ("cls", True), ("mean", False)],
    ids=["mean-normalized", "cls-normalized", "mean-no-normalize-module"],
)
def test_bert_embeddings_match_hf(pooling: str, normalize: bool, tmp_path: Path) -> None:
    """embed() equals HF BertModel + sentence-transformers pooling for a padded batch of mixed
    lengths.

    The batch mixes 3 to 15 tokens, so padded positions must be masked out of attention and of the
    mean. Without a Normalize module in modules.json the vectors must come back unnormalised.
    """
    model = hf_tiny.build_bert(seed=21)
    folder = hf_tiny.save_bert(model, tmp_path / "bert", pooling=pooling, normalize=normalize)
    got = float_llm(folder).embed(BERT_TEXTS)
    expected = _hf_embeddings(model, folder, BERT_TEXTS, pooling, normalize)
    _assert_embeddings_close(got, expected)
    norms = got.norm(dim=-1)
    if normalize:
        assert torch.allclose(norms, torch.ones_like(norms), atol=1e-5)
    else:
        assert (norms - 1).abs().min() > 0.1, "unnormalised vectors should not have unit length"


def test_bert_embedding_of_one_text_does_not_depend_on_its_batch(tmp_path: Path) -> None:
    """A text embedded alone equals the same text embedded next to a longer one (padding is inert)."""
    folder = hf_tiny.save_bert(hf_tiny.build_bert(seed=22), tmp_path / "bert")
    llm = float_llm(folder)
    alone = llm.embed([BERT_TEXTS[1]])
    batched = llm.embed(BERT_TEXTS)[1:2]
    assert _max_diff(alone, batched) <= 1e-5


def test_bert_without_sentence_transformers_files_mean_pools_and_normalizes(tmp_path: Path) -> None:
    """A bare HF BertModel folder (no modules.json, no 1_Pooling) gets rebar's default: mean + L2."""
    model = hf_tiny.build_bert(seed=23)
    folder = hf_tiny.save_bert(model, tmp_path / "bert", pooling=None)
    got = float_llm(folder).embed(BERT_TEXTS)
    _assert_embeddings_close(got, _hf_embeddings(model, folder, BERT_TEXTS, "mean", True))


def test_bert_truncates_to_max_seq_length(tmp_path: Path) -> None:
    """sentence_bert_config.json's max_seq_length truncates inputs ([CLS]/[SEP] included), as HF
    would see them."""
    model = hf_tiny.build_bert(seed=24)
    folder = hf_tiny.save_bert(model, tmp_path / "bert", max_seq_length=6)
    long_text = " ".join(hf_tiny.word(i) for i in range(10, 30))
    truncated = " ".join(
        hf_tiny.word(i) for i in range(10, 14)
    )  # 4 words + [CLS] + [SEP] = 6 tokens
    got = float_llm(folder).embed([long_text, BERT_TEXTS[0]])
    expected = _hf_embeddings(model, folder, [truncated, BERT_TEXTS[0]], "mean", True)
    _assert_embeddings_close(got, expected)


# ----- loader error paths -----------------------------------------------------------------


def test_sharded_checkpoint_loads_every_shard(tmp_path: Path) -> None:
    """A checkpoint split over several shards with an index gives the same logits as HF."""
    model = hf_tiny.build_decoder("LlamaForCausalLM", 31)
    folder = hf_tiny.save_decoder(model, tmp_path / "model", max_shard_size="40KB")
    shards = sorted(folder.glob("*.safetensors"))
    assert len(shards) >= 3 and (folder / "model.safetensors.index.json").is_file()
    ids = _random_ids(25, seed=5)
    got = float_llm(folder).logits(ids)
    assert _max_diff(got, _hf_logits(model, ids)) <= LOGIT_ATOL


def test_index_naming_a_missing_shard_is_a_format_error(tmp_path: Path) -> None:
    """An index whose weight_map names a shard that is not on disk raises ModelFormatError naming
    it."""
    folder = hf_tiny.save_decoder(
        hf_tiny.build_decoder("LlamaForCausalLM", 32), tmp_path / "model", max_shard_size="40KB"
    )
    missing = sorted(folder.glob("*.safetensors"))[-1]
    missing.unlink()
    with pytest.raises(ModelFormatError, match=missing.name):
        float_llm(folder)


def test_folder_without_config_is_a_format_error(tmp_path: Path) -> None:
    """No config.json: ModelFormatError that says config.json is missing."""
    _, folder = _decoder_folder(tmp_path, "LlamaForCausalLM", seed=33)
    (folder / "config.json").unlink()
    with pytest.raises(ModelFormatError, match=r"config\.json"):
        float_llm(folder)


def test_unsupported_architecture_is_named(tmp_path: Path) -> None:
    """An architecture rebar lacks raises UnsupportedModelError naming that architecture."""
    _, folder = _decoder_folder(tmp_path, "LlamaForCausalLM", seed=34)
    hf_tiny.edit_config(folder, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        float_llm(folder)


@pytest.mark.parametrize("act", ["gelu", "relu"])
def test_unsupported_decoder_activation_is_named(act: str, tmp_path: Path) -> None:
    """A Llama config with a hidden_act other than silu raises UnsupportedModelError naming it."""
    _, folder = _decoder_folder(tmp_path, "LlamaForCausalLM", seed=35)
    hf_tiny.edit_config(folder, hidden_act=act)
    with pytest.raises(UnsupportedModelError, match=repr(act)):
        float_llm(folder)


def test_unsupported_bert_activation_is_named(tmp_path: Path) -> None:
    """A BERT config with hidden_act other than exact gelu raises UnsupportedModelError naming it."""
    folder = hf_tiny.save_bert(hf_tiny.build_bert(seed=36), tmp_path / "bert")
    hf_tiny.edit_config(folder, hidden_act="gelu_new")
    with pytest.raises(UnsupportedModelError, match="gelu_new"):
        float_llm(folder)


@pytest.mark.parametrize("keep_fraction", [0.5, 0.999])
def test_truncated_safetensors_is_a_format_error(keep_fraction: float, tmp_path: Path) -> None:
    """A .safetensors file cut short raises ModelFormatError naming the file, not a library error."""
    _, folder = _decoder_folder(tmp_path, "LlamaForCausalLM", seed=37)
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: int(len(data) * keep_fraction)])
    with pytest.raises(ModelFormatError, match=r"model\.safetensors"):
        float_llm(folder)


def test_misshapen_tensor_is_named_with_both_shapes(tmp_path: Path) -> None:
    """A tensor whose shape disagrees with config.json raises ModelFormatError naming it and both
    shapes."""
    _, folder = _decoder_folder(tmp_path, "LlamaForCausalLM", seed=38)
    weights = folder / "model.safetensors"
    tensors = load_file(weights)
    name = "model.layers.1.mlp.up_proj.weight"
    assert tensors[name].shape == (112, 64)
    tensors[name] = torch.zeros(100, 64)
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(ModelFormatError) as info:
        float_llm(folder)
    message = str(info.value)
    assert name in message and "[100, 64]" in message and "[112, 64]" in message


class _Tripwire:
    """Unpickling this creates a marker file, proving that a pickle was loaded."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (Path.touch, (self.marker,))


def test_pytorch_bin_only_folder_is_refused_without_unpickling(tmp_path: Path) -> None:
    """A folder with only pytorch_model.bin raises ModelFormatError and never unpickles the file."""
    _, folder = _decoder_folder(tmp_path, "LlamaForCausalLM", seed=39)
    (folder / "model.safetensors").unlink()
    marker = tmp_path / "unpickled"
    (folder / "pytorch_model.bin").write_bytes(pickle.dumps(_Tripwire(marker)))
    with pytest.raises(ModelFormatError, match="safetensors"):
        float_llm(folder)
    assert not marker.exists()


def test_tied_checkpoint_without_lm_head_loads_and_untied_without_it_fails(tmp_path: Path) -> None:
    """Tied models need no lm_head.weight; an untied config missing it is a ModelFormatError naming
    it."""
    _, folder = _decoder_folder(tmp_path, "LlamaForCausalLM", seed=40, tie_word_embeddings=True)
    assert "lm_head.weight" not in load_file(folder / "model.safetensors")
    float_llm(folder)
    hf_tiny.edit_config(folder, tie_word_embeddings=False)
    with pytest.raises(ModelFormatError, match=r"lm_head\.weight"):
        float_llm(folder)


@pytest.mark.parametrize(
    ("arch", "edit", "named"),
    [
        ("Gemma3ForCausalLM", {"final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0"),
        ("Gemma3ForCausalLM", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0"),
        ("Qwen3ForCausalLM", {"partial_rotary_factor": 0.5}, "partial rotary"),
        (
            "Phi3ForCausalLM",
            {
                "rope_parameters": {
                    "rope_type": "longrope",
                    "rope_theta": 10000.0,
                    "short_factor": [1.0] * 8,
                    "long_factor": [2.0] * 8,
                }
            },
            "'longrope'",
        ),
    ],
    ids=["final-softcap", "attn-softcap", "partial-rotary", "longrope"],
)
def test_family_variants_rebar_lacks_are_refused(
    arch: str, edit: dict[str, Any], named: str, tmp_path: Path
) -> None:
    """Softcapped logits, partial rotary embeddings and LongRoPE change every logit: refused by name
    rather than run wrongly."""
    _, folder = _decoder_folder(tmp_path, arch, seed=36)
    hf_tiny.edit_config(folder, **edit)
    with pytest.raises(UnsupportedModelError, match=re.escape(named)):
        float_llm(folder)
