"""The `rebar` command as a user runs it: real subprocesses, real model, exit codes and messages."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from markers import requires_gemma3, requires_minilm, requires_smollm2
from suite_tiers import limit

pytestmark = limit("processes")  # tests/suite_tiers.py


def rebar(*args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rebar.cli", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=300,
    )


@requires_smollm2
def test_inspect_shows_architecture_types_tokenizer_and_template() -> None:
    result = rebar("inspect", "smollm2")
    assert result.returncode == 0, result.stderr
    for expected in (
        "gguf:llama",
        "num_kv_heads: 3",
        "Q4_1 x210",
        "Q8_0 x1",
        "vocab 49152",
        "<|im_start|>",
        "general.name: Smollm2 135M",
    ):
        assert expected in result.stdout


@requires_gemma3
def test_inspect_shows_the_family_traits() -> None:
    """Gemma 3's sliding/global layers, their two RoPE bases, its four norms per layer and GeGLU."""
    result = rebar("inspect", "gemma3")
    assert result.returncode == 0, result.stderr
    for expected in (
        "gguf:gemma3",
        "layers: 15 sliding (window 512), 3 global: SSSSSG SSSSSG SSSSSG",
        "rope: base 1,000,000 (global layers), 10,000 (sliding layers)",
        "before attention and MLP, and on their outputs; per-head RMSNorm on queries and keys",
        "mlp: GeGLU",
        "embedding: scaled by 25.3, tied",
        "SentencePiece",
        "'<end_of_turn>'",
    ):
        assert expected in result.stdout, expected


@requires_smollm2
def test_generate_streams_a_completion() -> None:
    result = rebar(
        "generate", "--model", "smollm2", "--max-tokens", "8", "The capital of France is"
    )
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout


@requires_smollm2
def test_chat_keeps_the_conversation_and_exits_cleanly() -> None:
    # (SmolLM2's own default system prompt makes this 135M model ramble, in llama.cpp exactly as in
    # rebar)
    result = rebar(
        "chat",
        "--model",
        "smollm2",
        "--max-tokens",
        "24",
        "--system",
        "You are a helpful AI assistant.",
        stdin="What is the capital of France?\n/exit\n",
    )
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout


def test_unknown_model_is_a_clean_error() -> None:
    result = rebar("inspect", "/no/such/model.gguf")
    assert result.returncode == 2
    assert result.stderr.startswith("error: ") and "Traceback" not in result.stderr


def _malformed_gguf(path: Path) -> Path:
    """A GGUF whose metadata claims zero attention heads (once a ZeroDivisionError traceback)."""
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), "llama")
    writer.add_uint32("llama.embedding_length", 64)
    writer.add_uint32("llama.attention.head_count", 0)
    writer.add_uint32("llama.block_count", 2)
    for write in (
        writer.write_header_to_file,
        writer.write_kv_data_to_file,
        writer.write_tensors_to_file,
    ):
        write()
    writer.close()
    return path


def _one_line_error(result: subprocess.CompletedProcess[str], *culprits: str) -> None:
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for culprit in culprits:
        assert culprit in lines[0]


def test_inspect_and_generate_of_malformed_models_print_one_line(tmp_path: Path) -> None:
    """Malformed files exit 2 with one `error:` line naming the key or what was cut, for `inspect`
    and for the loading path `generate` and `serve` share."""
    bad = _malformed_gguf(tmp_path / "bad.gguf")
    _one_line_error(rebar("inspect", str(bad)), "'llama.attention.head_count'", "0")
    _one_line_error(
        rebar("generate", "--model", str(bad), "--max-tokens", "1", "hi"),
        "'llama.attention.head_count'",
    )
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(bad.read_bytes()[:40])
    _one_line_error(rebar("inspect", str(cut)), "truncated", "metadata")
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text("[1, 2]")
    _one_line_error(
        rebar("inspect", str(folder)), "config.json", "an array where an object belongs"
    )


def test_invalid_sampling_value_is_a_clean_error() -> None:
    result = rebar("generate", "--top-p", "0", "hello")
    assert result.returncode == 2
    assert "top_p" in result.stderr and "Traceback" not in result.stderr


@requires_minilm
def test_bench_offline_refuses_an_embedding_model() -> None:
    result = rebar("bench", "offline", "--model", "minilm", "--num-prompts", "1")
    assert result.returncode == 2
    assert "embedding model" in result.stderr and "Traceback" not in result.stderr


@requires_smollm2
def test_profile_writes_a_chrome_trace_and_prints_top_operators(tmp_path) -> None:
    import json

    out = tmp_path / "trace.json"
    result = rebar(
        "profile",
        "--model",
        "smollm2",
        "--steps",
        "2",
        "--batch",
        "2",
        "--input-len",
        "16",
        "--top",
        "5",
        "--output",
        str(out),
    )
    assert result.returncode == 0, result.stderr
    assert (
        "Self CPU" in result.stdout and "2 steps in" in result.stdout and str(out) in result.stdout
    )
    names = {event.get("name") for event in json.loads(out.read_text())["traceEvents"]}
    assert {"layers.0", "layers.29.attn", "layers.29.mlp", "embed_tokens"} <= names


def test_profile_refuses_zero_steps() -> None:
    result = rebar("profile", "--steps", "0")
    assert result.returncode == 2 and "must be >= 1" in result.stderr


# --- setting flags: one per setting, derived from the settings' definitions ---------------------


def parse(*argv: str):
    from rebar.cli import build_parser

    return build_parser().parse_args(argv)


def test_engine_flags_reach_the_engine_config(monkeypatch) -> None:
    from rebar.config import EngineSettings
    from rebar.config.flags import settings_from_flags
    from rebar.llm import engine_config

    for name in [n for n in os.environ if n.upper().startswith("REBAR_")]:
        monkeypatch.delenv(name)

    args = parse(
        "generate",
        "--block-size", "8",
        "--kv-cache-fraction", "0.5",
        "--max-model-len", "none",
        "--attention-backend", "torch",
        "--no-fused-decode",
        "--kv-cache-dtype", "bfloat16",
        "hi",
    )  # fmt: skip
    assert (
        settings_from_flags(args).engine.engine_fields()
        == EngineSettings(
            block_size=8,
            kv_cache_fraction=0.5,
            attention_backend="torch",
            fused_decode=False,
            kv_cache_dtype="bfloat16",
        ).engine_fields()
    )
    # no flag: the defaults
    assert settings_from_flags(parse("chat")).engine.engine_fields() == (engine_config().__dict__)


def test_model_flags_reach_the_models_settings(tmp_path: Path) -> None:
    from rebar.config.flags import settings_from_flags

    config = tmp_path / "rebar.toml"
    config.write_text("[models]\ndtype = 'bfloat16'\n[engine]\nblock_size = 32\n")
    args = parse("generate", "--config", str(config), "--dequantize", "--block-size", "8", "hi")
    settings = settings_from_flags(args)
    assert (settings.models.dtype, settings.models.dequantize) == ("bfloat16", True)
    assert settings.engine.block_size == 8  # the flag wins over the file


def test_serve_flags_override_the_settings_file_and_unset_with_none(tmp_path: Path) -> None:
    from rebar.cli import serve_overrides
    from rebar.config import load_settings

    config = tmp_path / "rebar.toml"
    config.write_text("[engine]\nmax_model_len = 1024\nblock_size = 32\nmax_num_seqs = 4\n")
    args = parse(
        "serve", "--max-model-len", "none", "--block-size", "8", "--no-enable-prefix-caching"
    )
    engine = load_settings(config, serve_overrides(args)).engine
    assert (engine.max_model_len, engine.block_size, engine.enable_prefix_caching) == (
        None,
        8,
        False,
    )
    assert engine.max_num_seqs == 4  # no flag: the file's value stays


def test_invalid_serve_flag_is_a_config_error_naming_the_setting() -> None:
    from rebar.cli import serve_overrides
    from rebar.config import load_settings
    from rebar.errors import ConfigError

    with pytest.raises(ConfigError, match=r"engine\.block_size = 0 from overrides.*>= 1"):
        load_settings(None, serve_overrides(parse("serve", "--block-size", "0")))


def test_invalid_engine_flag_fails_before_the_model_loads(capsys) -> None:
    from rebar.cli import main

    assert main(["generate", "--model", "/no/such/model.gguf", "--max-model-len", "1", "hi"]) == 2
    err = capsys.readouterr().err
    assert "error: invalid setting engine.max_model_len = 1 from the command line" in err
    assert "allowed: an integer >= 2" in err


def test_bad_kv_cache_dtype_flag_is_refused_with_the_valid_names() -> None:
    result = rebar("bench", "offline", "--kv-cache-dtype", "int8")
    assert result.returncode == 2
    assert "--kv-cache-dtype: invalid choice: 'int8'" in result.stderr
    assert "'auto', 'float32', 'float16', 'bfloat16'" in result.stderr


def test_bench_offline_and_profile_set_the_batch_from_their_own_flags() -> None:
    from rebar.config.flags import settings_from_flags

    args = parse("bench", "offline", "--concurrency", "4", "--max-num-batched-tokens", "256")
    engine = settings_from_flags(args, **{"engine.max_num_seqs": args.concurrency}).engine
    assert (engine.max_num_seqs, engine.max_num_batched_tokens) == (4, 256)
    for command in (("bench", "offline"), ("profile",)):
        with pytest.raises(SystemExit):
            parse(*command, "--max-num-seqs", "2")  # --concurrency / --batch set it
