"""Settings: layering (defaults < TOML < REBAR_* env < overrides), strictness, masking, `rebar
config show`."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from pydantic import ValidationError

from markers import requires_smollm2
from rebar.config import (
    PROCESS_ENV_SWITCHES,
    McpServerSettings,
    ServedModelSettings,
    Settings,
    load_settings,
    to_toml,
)
from rebar.errors import ConfigError

EXAMPLE_TOML = Path(__file__).resolve().parents[1] / "rebar.toml"
SECRET = "sk-test-0123456789abcdef"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No REBAR_* variable from the developer's shell leaks into a test."""
    for name in list(os.environ):
        if name.upper().startswith("REBAR_"):
            monkeypatch.delenv(name)
    return monkeypatch


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


# --- defaults and the example file ------------------------------------------------------------


def test_defaults() -> None:
    settings = load_settings()
    assert settings == Settings()
    assert (settings.server.host, settings.server.port, settings.server.api_keys) == (
        "127.0.0.1",
        8000,
        (),
    )
    assert settings.server.max_body_bytes == 2**20 and settings.server.drain_timeout_s == 30
    assert (
        settings.models.chat,
        settings.models.embedding,
        settings.models.dtype,
        settings.models.device,
    ) == ("smollm2", "minilm", "float32", "auto")
    assert (
        settings.limits.max_waiting_requests == 256
        and settings.limits.max_waiting_prompt_tokens == 262144
    )
    assert settings.limits.request_timeout_s == 600 and settings.limits.retry_after_s == 1
    assert settings.logging.level == "info"
    assert settings.api_key_hashes() == frozenset()


def test_engine_settings_reach_engine_config() -> None:
    from rebar.engine.engine_config import EngineConfig

    custom = load_settings(
        overrides={
            "engine.max_model_len": 512,
            "engine.kv_cache_memory": 2**20,
            "engine.attention_backend": "torch",
            "engine.num_threads": 2,
            "engine.kv_cache_dtype": "float16",
        }
    )
    config = EngineConfig(**custom.engine.engine_fields())
    assert (config.max_model_len, config.kv_cache_memory, config.attention_backend) == (
        512,
        2**20,
        "torch",
    )
    assert config.kv_cache_dtype == "float16"
    assert custom.engine.num_threads == 2  # not an EngineConfig field: applied by the server


@pytest.mark.parametrize("layer", ["toml", "env", "override"])
def test_invalid_engine_setting_is_a_config_error_from_every_layer(
    layer: str, tmp_path: Path, clean_env: pytest.MonkeyPatch
) -> None:
    """The engine section is derived from EngineConfig's definitions; its checks and the file,
    variable or flag the value came from are in the message, with the valid names."""
    text = '[engine]\nkv_cache_dtype = "int8"\n' if layer == "toml" else ""
    config = write(tmp_path / "bad.toml", text)
    if layer == "env":
        clean_env.setenv("REBAR_ENGINE__KV_CACHE_DTYPE", "int8")
    overrides = {"engine.kv_cache_dtype": "int8"} if layer == "override" else None
    with pytest.raises(ConfigError) as caught:
        load_settings(config, overrides)
    message = str(caught.value)
    assert "engine.kv_cache_dtype = 'int8'" in message
    assert "one of 'auto', 'float32', 'float16', 'bfloat16'" in message
    origin = {"toml": "bad.toml", "env": "REBAR_ENGINE__KV_CACHE_DTYPE", "override": "overrides"}
    assert origin[layer] in message


def test_engine_settings_keep_their_bounds_types_and_unset(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("REBAR_ENGINE__FUSED_DECODE", "false")
    clean_env.setenv("REBAR_ENGINE__ATTENTION_BACKEND", "torch")
    engine = load_settings(
        overrides={"engine.kv_cache_memory": "", "engine.block_size": "8"}
    ).engine
    assert (engine.fused_decode, engine.attention_backend) == (False, "torch")
    assert (engine.kv_cache_memory, engine.block_size) == (None, 8)
    with pytest.raises(ConfigError, match=r"engine\.block_size = True .*an integer >= 1"):
        load_settings(overrides={"engine.block_size": True})
    with pytest.raises(ConfigError, match=r"engine\.max_num_seqs = 0 .*>= 1"):
        load_settings(overrides={"engine.max_num_seqs": 0})


def test_example_toml_loads_and_equals_the_defaults() -> None:
    assert load_settings(EXAMPLE_TOML) == Settings()


def test_example_toml_shows_every_key_with_a_comment() -> None:
    section, seen = None, set()
    lines = EXAMPLE_TOML.read_text(encoding="utf-8").splitlines()
    for index, line in enumerate(lines):
        if match := re.fullmatch(r"\[(\w+)\]", line.strip()):
            section = match.group(1)
        elif match := re.fullmatch(r"#\s*\[\[(\w+)\.(\w+)\]\]", line.strip()):
            section = f"{match.group(1)}.{match.group(2)}"  # an example table of a list
        elif section and (match := re.fullmatch(r"#?\s*(\w+)\s*=.*", line.strip())):
            assert lines[index - 1].startswith("#"), (
                f"{section}.{match.group(1)} has no comment line"
            )
            seen.add(f"{section}.{match.group(1)}")
    expected = {
        f"{name}.{key}"
        for name, field in Settings.model_fields.items()
        for key in field.annotation.model_fields
    }
    expected |= {f"models.serve.{key}" for key in ServedModelSettings.model_fields}
    expected |= {f"mcp.servers.{key}" for key in McpServerSettings.model_fields}
    assert seen == expected


# --- precedence -------------------------------------------------------------------------------


def test_precedence_toml_env_overrides(tmp_path: Path, clean_env: pytest.MonkeyPatch) -> None:
    config = write(
        tmp_path / "rebar.toml",
        '[server]\nport = 9001\nhost = "0.0.0.0"\n[models]\nchat = "from-toml"\n',
    )
    clean_env.setenv("REBAR_SERVER__PORT", "9002")
    clean_env.setenv("REBAR_MODELS__CHAT", "from-env")
    clean_env.setenv("REBAR_LIMITS__RETRY_AFTER_S", "5")
    settings = load_settings(config, {"server.port": 9003, "models.dtype": "bfloat16"})
    assert settings.server.port == 9003  # set by all three layers: the override wins
    assert settings.models.chat == "from-env"  # file and env: env wins
    assert settings.server.host == "0.0.0.0"  # file only
    assert settings.limits.retry_after_s == 5  # env only
    assert settings.models.dtype == "bfloat16"  # override only
    assert settings.models.embedding == "minilm"  # nobody: default


def test_toml_beats_defaults_and_env_beats_toml(
    tmp_path: Path, clean_env: pytest.MonkeyPatch
) -> None:
    config = write(tmp_path / "rebar.toml", "[server]\nport = 9001\n")
    assert load_settings(config).server.port == 9001
    clean_env.setenv("REBAR_SERVER__PORT", "9002")
    assert load_settings(config).server.port == 9002


def test_none_overrides_are_skipped() -> None:
    assert load_settings(overrides={"server.port": None, "models.chat": "x"}).models.chat == "x"


def test_nested_env_vars(tmp_path: Path, clean_env: pytest.MonkeyPatch) -> None:
    config = write(tmp_path / "rebar.toml", '[server]\nhost = "10.0.0.1"\n')
    clean_env.setenv("REBAR_SERVER__API_KEYS", '["k1", "k2"]')
    clean_env.setenv("REBAR_SERVER__CORS_ALLOW_ORIGINS", '["http://a.example"]')
    clean_env.setenv("rebar_engine__enable_prefix_caching", "false")  # names are case-insensitive
    clean_env.setenv("REBAR_ENGINE__MAX_MODEL_LEN", "4096")
    clean_env.setenv("REBAR_LOGGING", '{"level": "DEBUG"}')  # a whole section as JSON
    settings = load_settings(config)
    assert [key.get_secret_value() for key in settings.server.api_keys] == ["k1", "k2"]
    assert settings.server.cors_allow_origins == ("http://a.example",)
    assert settings.server.host == "10.0.0.1"  # the file's other keys in the section survive
    assert settings.engine.enable_prefix_caching is False
    assert settings.engine.max_model_len == 4096
    assert settings.logging.level == "debug"


def test_blank_or_none_unsets_optional_settings(
    tmp_path: Path, clean_env: pytest.MonkeyPatch
) -> None:
    config = write(
        tmp_path / "rebar.toml", '[models]\nembedding = ""\n[engine]\nmax_model_len = 1024\n'
    )
    clean_env.setenv("REBAR_ENGINE__MAX_MODEL_LEN", "none")
    settings = load_settings(config)
    assert settings.models.embedding is None and settings.engine.max_model_len is None
    with pytest.raises(ConfigError, match="nothing to serve"):
        load_settings(config, {"models.chat": "none"})


def test_settings_are_frozen_and_ignore_the_environment(clean_env: pytest.MonkeyPatch) -> None:
    settings = load_settings()
    with pytest.raises(ValidationError):
        settings.server.port = 1  # type: ignore[misc]
    with pytest.raises(ValidationError):
        settings.server = settings.server  # type: ignore[misc]
    clean_env.setenv("REBAR_SERVER__PORT", "9999")
    assert Settings().server.port == 8000  # only load_settings reads the environment


# --- invalid values and unknown keys ------------------------------------------------------------


@pytest.mark.parametrize("layer", ["toml", "env", "override"])
def test_invalid_port_names_key_value_range_and_source(
    layer: str, tmp_path: Path, clean_env: pytest.MonkeyPatch
) -> None:
    config = write(tmp_path / "bad.toml", "[server]\nport = 70000\n" if layer == "toml" else "")
    if layer == "env":
        clean_env.setenv("REBAR_SERVER__PORT", "70000")
    overrides = {"server.port": 70000} if layer == "override" else None
    with pytest.raises(ConfigError) as caught:
        load_settings(config, overrides)
    message = str(caught.value)
    assert "server.port" in message and "70000" in message and "1 to 65535" in message
    assert {"toml": "bad.toml", "env": "REBAR_SERVER__PORT", "override": "overrides"}[
        layer
    ] in message


@pytest.mark.parametrize(
    ("key", "value", "allowed"),
    [
        ("models.dtype", "int8", "'float32', 'float16', 'bfloat16'"),
        ("logging.level", "loud", "'debug', 'info', 'warning', 'error'"),
        ("models.device", "tpu", "cuda:N"),
        ("server.port", "eighty", "an integer from 1 to 65535"),
        ("server.max_body_bytes", 10, ">= 1024"),
        ("engine.kv_cache_fraction", 1.5, "> 0.0 and <= 1.0"),
        ("engine.max_model_len", 1, ">= 2"),
        ("engine.kv_cache_dtype", "int8", "'auto', 'float32', 'float16', 'bfloat16'"),
        ("limits.request_timeout_s", 0, "> 0"),
        ("limits.max_waiting_requests", 0, ">= 1"),
    ],
)
def test_invalid_values_name_the_allowed_values(key: str, value: object, allowed: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_settings(overrides={key: value})
    assert (
        key in str(caught.value)
        and repr(value) in str(caught.value)
        and allowed in str(caught.value)
    )


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("[server]\nprot = 9000\n", "server.prot"),
        ("[bogus]\nx = 1\n", "bogus"),
        ("port = 9000\n", "port"),
    ],
)
def test_unknown_toml_key_is_an_error(text: str, named: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=re.escape(named)) as caught:
        load_settings(write(tmp_path / "rebar.toml", text))
    assert "unknown setting" in str(caught.value) and "rebar.toml" in str(caught.value)


def test_unknown_key_suggests_the_close_one(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"did you mean 'server\.port'"):
        load_settings(write(tmp_path / "rebar.toml", "[server]\nprot = 9000\n"))


@pytest.mark.parametrize(
    "name", ["REBAR_SERVER__PROT", "REBAR_BOGUS", "REBAR_SERVER__PORT__X", "REBAR_"]
)
def test_unknown_env_var_is_an_error(name: str, clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv(name, "1")
    with pytest.raises(ConfigError, match=f"unknown setting.*{name}"):
        load_settings()


def test_process_switches_are_not_settings(clean_env: pytest.MonkeyPatch) -> None:
    """REBAR_DISABLE_CPU_KERNELS and REBAR_CPU_ISA are read by the CPU kernels, REBAR_LLAMA_CPP_BIN
    by the benchmarks: never rejected as unknown settings."""
    from rebar.kernels.cpu_quant.build import DISABLE_ENV, ISA_ENV
    from rebar_bench.llamacpp import BIN_ENV

    assert {DISABLE_ENV, ISA_ENV, BIN_ENV} == PROCESS_ENV_SWITCHES
    clean_env.setenv(DISABLE_ENV, "1")
    clean_env.setenv(ISA_ENV, "avx2")
    clean_env.setenv(BIN_ENV, "/opt/llama.cpp/build/bin")
    assert load_settings() == Settings()


def test_unknown_key_inside_env_json_is_an_error(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("REBAR_SERVER", '{"prot": 1}')
    with pytest.raises(ConfigError, match=r"unknown setting 'server\.prot'.*REBAR_SERVER"):
        load_settings()


def test_env_list_must_be_json_and_the_error_hides_the_value(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("REBAR_SERVER__API_KEYS", SECRET)
    with pytest.raises(ConfigError, match="REBAR_SERVER__API_KEYS is not valid JSON") as caught:
        load_settings()
    assert SECRET not in str(caught.value)


@pytest.mark.parametrize("key", ["server.prot", "port", "server.port.x", "bogus.port"])
def test_unknown_override_is_an_error(key: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(key)):
        load_settings(overrides={key: 1})


def test_missing_and_unparsable_files_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"missing\.toml.*not found"):
        load_settings(tmp_path / "missing.toml")
    with pytest.raises(ConfigError, match=r"broken\.toml"):
        load_settings(write(tmp_path / "broken.toml", "[server\nport = \n"))
    with pytest.raises(ConfigError, match=re.escape(str(tmp_path))):
        load_settings(tmp_path)  # a folder


# --- secrets -----------------------------------------------------------------------------------


def test_masked_output_never_contains_a_key(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("REBAR_SERVER__API_KEYS", json.dumps([SECRET, SECRET + "-2"]))
    settings = load_settings()
    masked = settings.masked_dict()
    assert masked["server"]["api_keys"] == ["***", "***"]
    for text in (json.dumps(masked), to_toml(masked), repr(settings), str(settings)):
        assert SECRET not in text
    assert masked["server"]["port"] == 8000


def test_to_toml_round_trips(tmp_path: Path) -> None:
    settings = load_settings(
        overrides={"server.port": 9005, "models.embedding": "", "server.cors_allow_origins": ["x"]}
    )
    assert (
        load_settings(write(tmp_path / "shown.toml", to_toml(settings.masked_dict()))) == settings
    )


def test_invalid_key_error_does_not_echo_it() -> None:
    with pytest.raises(ConfigError, match=r"server\.api_keys") as caught:
        load_settings(overrides={"server.api_keys": [SECRET + " with-space"]})
    assert SECRET not in str(caught.value)


def test_api_key_file_skips_blanks_and_comments_relative_to_the_toml(tmp_path: Path) -> None:
    from rebar.server.auth import hash_key

    (tmp_path / "conf").mkdir()
    write(tmp_path / "conf" / "keys.txt", "# team A\nkey-a\n\n   key-b  \n#key-c\n\t\n")
    config = write(
        tmp_path / "conf" / "rebar.toml",
        '[server]\napi_keys = ["key-z"]\napi_key_file = "keys.txt"\n',
    )
    settings = load_settings(config)
    assert settings.server.api_key_file == tmp_path / "conf" / "keys.txt"
    assert settings.api_key_hashes() == frozenset(
        hash_key(key) for key in ("key-a", "key-b", "key-z")
    )


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (None, "cannot read server.api_key_file"),  # missing
        ("# only comments\n\n", "holds no keys"),
        ("good\nbad key\n", "line 2"),
    ],
)
def test_bad_api_key_file_is_a_config_error(
    content: str | None, match: str, tmp_path: Path
) -> None:
    path = tmp_path / "keys.txt"
    if content is not None:
        write(path, content)
    settings = load_settings(overrides={"server.api_key_file": str(path)})
    with pytest.raises(ConfigError, match=match) as caught:
        settings.api_key_hashes()
    assert "bad key" not in str(caught.value)


def test_api_key_file_that_is_a_folder_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"cannot read server\.api_key_file"):
        load_settings(overrides={"server.api_key_file": str(tmp_path)}).api_key_hashes()


# --- rebar config show --------------------------------------------------------------------------


def rebar(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    clean = {
        name: value for name, value in os.environ.items() if not name.upper().startswith("REBAR_")
    }
    return subprocess.run(
        [sys.executable, "-m", "rebar.cli", *args],
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_config_show_prints_effective_settings_with_keys_masked(tmp_path: Path) -> None:
    config = write(
        tmp_path / "rebar.toml",
        f'[server]\nport = 9001\napi_keys = ["{SECRET}"]\n[models]\nchat = "mine"\n',
    )
    result = rebar("config", "show", "--config", str(config), env={"REBAR_SERVER__PORT": "9123"})
    assert result.returncode == 0, result.stderr
    shown = tomllib.loads(result.stdout)
    assert shown["server"]["port"] == 9123 and shown["models"]["chat"] == "mine"
    assert shown["server"]["api_keys"] == ["***"]
    assert "# auth: on, 1 distinct key(s)" in result.stdout
    assert SECRET not in result.stdout + result.stderr


def test_config_show_json(tmp_path: Path) -> None:
    result = rebar(
        "config", "show", "--format", "json", env={"REBAR_SERVER__API_KEYS": json.dumps([SECRET])}
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["server"]["api_keys"] == ["***"]
    assert SECRET not in result.stdout


def test_config_show_reports_errors_with_exit_2(tmp_path: Path) -> None:
    result = rebar("config", "show", env={"REBAR_SERVER__PORT": "0"})
    assert result.returncode == 2
    assert (
        result.stderr.startswith("error: ")
        and "server.port" in result.stderr
        and "1 to 65535" in result.stderr
    )
    result = rebar("config", "show", "--config", str(tmp_path / "nope.toml"), env={})
    assert result.returncode == 2 and "nope.toml" in result.stderr


@requires_smollm2
def test_engine_settings_reach_the_served_engine() -> None:
    """What the server loads runs on the [engine] settings: batching, block size, KV cache."""
    import torch

    from rebar.engine.scheduler import SchedulerConfig
    from rebar.server.app import load_models

    settings = load_settings(
        overrides={
            "models.embedding": "",
            "engine.max_num_seqs": 3,
            "engine.max_num_batched_tokens": 64,
            "engine.max_prefill_tokens_while_decoding": 24,
            "engine.block_size": 8,
            "engine.max_model_len": 256,
            "engine.kv_cache_memory": 2**23,
            "engine.kv_cache_dtype": "bfloat16",
        }
    )
    core = load_models(settings).chat.engine
    assert core.scheduler.config == SchedulerConfig(3, 64, 24)
    assert core.max_model_len == 256 and core.kv_manager.block_size == 8
    assert core.runner.kv_cache.keys[0].dtype == torch.bfloat16
    assert core.runner.kv_cache.num_bytes <= 2**23
