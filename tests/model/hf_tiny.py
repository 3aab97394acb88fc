"""Tiny random Hugging Face models saved as folders rebar can load, for parity tests.

Everything is built here from a seed: a config, a `transformers` model with every parameter
(biases and norm weights included) drawn at random, and a word-level tokenizer whose vocabulary
size matches the model's. Nothing is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
from torch import nn

DECODER_SPECIALS = ("<unk>", "<s>", "</s>")
BERT_SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


def word(index: int) -> str:
    """The plain vocabulary entry with id `index` (ids below the special tokens are never words)."""
    return f"w{index}"


def _vocab(specials: tuple[str, ...], size: int) -> dict[str, int]:
    vocab = {token: i for i, token in enumerate(specials)}
    vocab.update({word(i): i for i in range(len(specials), size)})
    return vocab


def write_decoder_tokenizer(folder: Path, vocab_size: int) -> None:
    """A whitespace word-level tokenizer over `vocab_size` ids, with <s>/</s> as BOS/EOS."""
    tokenizer = Tokenizer(models.WordLevel(_vocab(DECODER_SPECIALS, vocab_size), unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(list(DECODER_SPECIALS))
    tokenizer.save(str(folder / "tokenizer.json"))
    _write_json(
        folder / "tokenizer_config.json",
        {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": False},
    )


def write_bert_tokenizer(folder: Path, vocab_size: int) -> None:
    """A WordPiece tokenizer that wraps every input as [CLS] ... [SEP], like BERT's."""
    tokenizer = Tokenizer(models.WordPiece(_vocab(BERT_SPECIALS, vocab_size), unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", 2), ("[SEP]", 3)],
    )
    tokenizer.add_special_tokens(list(BERT_SPECIALS))
    tokenizer.save(str(folder / "tokenizer.json"))
    _write_json(
        folder / "tokenizer_config.json",
        {"cls_token": "[CLS]", "sep_token": "[SEP]", "pad_token": "[PAD]"},
    )


def randomize(model: nn.Module, seed: int, std: float = 0.15) -> None:
    """Redraw every parameter: weights and biases ~ N(0, std), norm scales ~ 1 + N(0, std)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator) * std
            is_norm_scale = param.ndim == 1 and "norm" in name.lower() and name.endswith("weight")
            param.copy_(noise + 1.0 if is_norm_scale else noise)


def decoder_config(arch: str, **overrides: Any) -> Any:
    """A tiny `transformers` config for one of the Llama-family decoders rebar runs."""
    import transformers

    config_class = {
        "LlamaForCausalLM": transformers.LlamaConfig,
        "MistralForCausalLM": transformers.MistralConfig,
        "Qwen2ForCausalLM": transformers.Qwen2Config,
        "Qwen3ForCausalLM": transformers.Qwen3Config,
        "Gemma3ForCausalLM": transformers.Gemma3TextConfig,
        "Phi3ForCausalLM": transformers.Phi3Config,
    }[arch]
    values: dict[str, Any] = {
        "vocab_size": 160,
        "hidden_size": 64,
        "intermediate_size": 112,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "attn_implementation": "eager",
    }
    values.update(overrides)
    return config_class(**values)


def build_decoder(arch: str, seed: int, **overrides: Any) -> nn.Module:
    """A random HF causal LM (float32, eval mode) for the given architecture and config overrides."""
    import transformers

    torch.manual_seed(seed)
    config = decoder_config(arch, **overrides)
    model = getattr(transformers, arch)(config)
    randomize(model, seed)
    return model.eval()


def save_decoder(model: nn.Module, folder: Path, **save_kwargs: Any) -> Path:
    """Write `model` (safetensors) and a matching tokenizer into `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, **save_kwargs)
    write_decoder_tokenizer(folder, model.config.vocab_size)
    return folder


def build_bert(seed: int, **overrides: Any) -> nn.Module:
    """A random HF BertModel (float32, eval mode)."""
    import transformers

    torch.manual_seed(seed)
    values: dict[str, Any] = {
        "vocab_size": 120,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "max_position_embeddings": 64,
        "type_vocab_size": 2,
        "pad_token_id": 0,
        "hidden_act": "gelu",
    }
    values.update(overrides)
    model = transformers.BertModel(transformers.BertConfig(**values))
    randomize(model, seed)
    return model.eval()


def save_bert(
    model: nn.Module,
    folder: Path,
    pooling: str | None = "mean",
    normalize: bool = True,
    max_seq_length: int | None = None,
) -> Path:
    """Write a sentence-transformers style folder; `pooling=None` writes no sentence-transformers
    files."""
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    write_bert_tokenizer(folder, model.config.vocab_size)
    if pooling is not None:
        (folder / "1_Pooling").mkdir()
        _write_json(
            folder / "1_Pooling" / "config.json",
            {
                "word_embedding_dimension": model.config.hidden_size,
                "pooling_mode_cls_token": pooling == "cls",
                "pooling_mode_mean_tokens": pooling == "mean",
                "pooling_mode_max_tokens": False,
            },
        )
        modules = [
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {
                "idx": 1,
                "name": "1",
                "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling",
            },
        ]
        if normalize:
            modules.append(
                {
                    "idx": 2,
                    "name": "2",
                    "path": "2_Normalize",
                    "type": "sentence_transformers.models.Normalize",
                }
            )
        _write_json(folder / "modules.json", modules)
    if max_seq_length is not None:
        _write_json(
            folder / "sentence_bert_config.json",
            {"max_seq_length": max_seq_length, "do_lower_case": False},
        )
    return folder


def edit_config(folder: Path, **changes: Any) -> None:
    """Rewrite keys of `folder/config.json`; a value of None deletes the key."""
    path = folder / "config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    _write_json(path, config)


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2), encoding="utf-8")
