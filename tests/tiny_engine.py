"""A tiny random Llama and word-level tokenizer wired into an EngineCore, for engine tests without a
checkpoint."""

from __future__ import annotations

from pathlib import Path

import torch

from rebar.engine.core import EngineCore
from rebar.engine.engine_config import kv_bytes_per_token
from rebar.llm import engine_config
from rebar.model.config import ModelConfig
from rebar.model.llama import LlamaModel
from rebar.model.tokenizer import Tokenizer

VOCAB = 96


def tiny_config(**overrides) -> ModelConfig:
    fields = dict(
        architecture="llama",
        vocab_size=VOCAB,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        intermediate_size=128,
        max_position_embeddings=256,
        norm_eps=1e-5,
    )
    return ModelConfig(**{**fields, **overrides})


def tiny_model(config: ModelConfig, seed: int = 0) -> LlamaModel:
    torch.manual_seed(seed)
    model = LlamaModel(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(
                1.0 + 0.1 * torch.randn_like(param)
                if "norm" in name
                else torch.randn_like(param) * 0.3
            )
    return model.eval().requires_grad_(False)


def tiny_tokenizer(folder: Path, characters: bool = False) -> Tokenizer:
    """Words w2..w95 (or, with `characters`, a byte-level BPE of single characters: space,
    newline and ASCII '!'..'}' but the backtick, which grammar libraries can read token bytes
    from)."""
    from tokenizers import Tokenizer as BackendTokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    if characters:
        return _character_tokenizer(folder)
    vocab = {"<s>": 0, "</s>": 1, **{f"w{i}": i for i in range(2, VOCAB)}}
    backend = BackendTokenizer(WordLevel(vocab, unk_token="<s>"))
    backend.pre_tokenizer = WhitespaceSplit()
    backend.add_special_tokens(["<s>", "</s>"])
    folder.mkdir(parents=True, exist_ok=True)
    backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text('{"bos_token": "<s>", "eos_token": "</s>"}')
    return Tokenizer.from_hf_folder(folder)


def _character_tokenizer(folder: Path) -> Tokenizer:
    from tokenizers import Tokenizer as BackendTokenizer
    from tokenizers import decoders, pre_tokenizers
    from tokenizers.models import BPE

    # Byte-level spellings: \u0120 is a space, \u010a a newline (the backtick makes room for it).
    printable = [chr(c) for c in range(ord("!"), ord("}") + 1) if chr(c) != "`"]
    characters = ["\u0120", "\u010a", *printable]
    vocab = {"<s>": 0, "</s>": 1, **{c: i + 2 for i, c in enumerate(characters)}}
    assert len(vocab) == VOCAB
    backend = BackendTokenizer(BPE(vocab, [], unk_token=None))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(["<s>", "</s>"])
    folder.mkdir(parents=True, exist_ok=True)
    backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text('{"bos_token": "<s>", "eos_token": "</s>"}')
    return Tokenizer.from_hf_folder(folder)


def make_core(
    tmp_path: Path,
    num_blocks: int = 64,
    seed: int = 0,
    characters: bool = False,
    config: ModelConfig | None = None,
    **engine: object,
) -> EngineCore:
    config = config or tiny_config()
    settings = {"block_size": 4, "max_model_len": 128, **engine}
    kv_dtype = engine_config(**settings).kv_dtype(torch.float32, torch.device("cpu"))
    block_bytes = kv_bytes_per_token(config, kv_dtype) * int(settings["block_size"])
    values = engine_config(**{"kv_cache_memory": num_blocks * block_bytes, **settings})
    return EngineCore(
        tiny_model(config, seed),
        config,
        tiny_tokenizer(tmp_path / "tok", characters),
        values,
        torch.float32,
        torch.device("cpu"),
    )


def run_to_completion(core: EngineCore, max_steps: int = 10_000) -> dict[tuple[str, int], list]:
    """Step until idle; returns (request_id, index) -> every RequestOutput of that choice."""
    outputs: dict[tuple[str, int], list] = {}
    for _ in range(max_steps):
        if not core.has_unfinished_requests():
            return outputs
        for output in core.step():
            outputs.setdefault((output.request_id, output.index), []).append(output)
        core.check_integrity()
    raise AssertionError("engine did not finish")


def tokens_of(outputs: list) -> list[int]:
    return [t for o in outputs for t in o.new_token_ids]
