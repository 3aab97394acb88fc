"""The [engine] settings have one definition (rebar.config.EngineSettings): LLM(...) keyword
arguments and engine_config(...) are checked against it, strictly, before anything loads; the engine
itself takes plain values."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rebar.config import EngineSettings
from rebar.config.engine_settings import PROCESS_FIELDS
from rebar.dtypes import DTYPE_NAMES
from rebar.engine.engine_config import EngineConfig, torch_dtype
from rebar.engine.scheduler import SchedulerConfig
from rebar.errors import ConfigError
from rebar.llm import engine_config


@pytest.mark.parametrize(
    ("values", "key", "allowed"),
    [
        ({"block_size": 0}, "engine.block_size", "an integer >= 1"),
        ({"block_size": 16.0}, "engine.block_size", "an integer >= 1"),
        ({"max_num_seqs": True}, "engine.max_num_seqs", "an integer >= 1"),
        ({"max_model_len": 1}, "engine.max_model_len", "an integer >= 2"),
        ({"kv_cache_memory": 0}, "engine.kv_cache_memory", "an integer > 0"),
        ({"kv_cache_fraction": 1.5}, "engine.kv_cache_fraction", "a number > 0.0 and <= 1.0"),
        ({"kv_cache_fraction": "0.5"}, "engine.kv_cache_fraction", "a number > 0.0 and <= 1.0"),
        ({"enable_prefix_caching": 1}, "engine.enable_prefix_caching", "true or false"),
        ({"attention_backend": 3}, "engine.attention_backend", "a string"),
        ({"block_size": None}, "engine.block_size", "an integer >= 1"),
    ],
)
def test_invalid_values_raise_config_error_naming_the_setting(values, key, allowed) -> None:
    with pytest.raises(ConfigError) as caught:
        engine_config(**values)
    message = str(caught.value)
    assert key in message and repr(next(iter(values.values()))) in message
    assert "in engine_config(...) arguments" in message
    assert f"allowed: {allowed}" in message


def test_unknown_kv_cache_dtype_is_refused_with_the_valid_names() -> None:
    with pytest.raises(ConfigError) as caught:
        engine_config(kv_cache_dtype="int8")
    assert "engine.kv_cache_dtype = 'int8'" in str(caught.value)
    assert "one of 'auto', 'float32', 'float16', 'bfloat16'" in str(caught.value)


def test_unknown_and_process_settings_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"unknown setting 'engine.blok_size'.*did you mean"):
        engine_config(blok_size=8)
    for name in PROCESS_FIELDS:  # they belong to whoever runs the engine, not to the engine
        with pytest.raises(ConfigError, match=f"unknown setting 'engine.{name}'"):
            engine_config(**{name: 1})


def test_valid_values_are_kept_and_the_rest_are_the_settings_defaults() -> None:
    config = engine_config(
        block_size=8, max_model_len=None, kv_cache_fraction=1, kv_cache_dtype="bfloat16"
    )
    assert (config.block_size, config.max_model_len, config.kv_cache_fraction) == (8, None, 1)
    assert config.kv_dtype(torch.float32, torch.device("cpu")) == torch.bfloat16
    defaults = EngineSettings()
    assert config.max_num_seqs == defaults.max_num_seqs
    assert engine_config() == EngineConfig(**defaults.engine_fields())


def test_the_engine_takes_exactly_the_engine_settings() -> None:
    """Every EngineSettings field but the process's own is an EngineConfig field, and nothing
    else is: a setting added on one side only fails here."""
    engine_fields = {field.name for field in dataclasses.fields(EngineConfig)}
    assert engine_fields == set(EngineSettings.model_fields) - PROCESS_FIELDS
    assert set(EngineSettings().engine_fields()) == engine_fields


def test_every_dtype_name_is_a_torch_dtype() -> None:
    for name in DTYPE_NAMES:
        assert torch_dtype(name).is_floating_point
        config = engine_config(kv_cache_dtype=name)
        assert config.kv_dtype(torch.float32, torch.device("cpu")) == getattr(torch, name)


def test_scheduler_config_takes_the_engine_settings_it_shares() -> None:
    config = engine_config(
        max_num_seqs=3, max_num_batched_tokens=64, max_prefill_tokens_while_decoding=24
    )
    assert SchedulerConfig.of(config) == SchedulerConfig(3, 64, 24)


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"dtype": "int8"}, "'int8'"),
        ({"device": "tpu"}, "'tpu'"),
        ({"max_model_len": 1}, "engine.max_model_len"),
        ({"max_model_len": "long"}, "engine.max_model_len"),
    ],
)
def test_llm_settings_are_checked_before_the_model_is_opened(kwargs, named) -> None:
    """A missing model would raise ModelNotFoundError: the ConfigError comes first."""
    from rebar.llm import LLM

    with pytest.raises(ConfigError, match=named):
        LLM(model="/no/such/model.gguf", **kwargs)


def test_llm_takes_engine_config_or_engine_settings_not_both() -> None:
    from rebar.errors import InvalidRequestError
    from rebar.llm import LLM

    with pytest.raises(InvalidRequestError, match="not both"):
        LLM(model="/no/such/model.gguf", engine_config=engine_config(), block_size=8)
