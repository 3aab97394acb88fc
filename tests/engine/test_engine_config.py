"""EngineConfig checks its settings from their one definition; SchedulerConfig and LLM(...) share
it."""

from __future__ import annotations

import pytest
import torch

from rebar.engine.engine_config import DTYPE_NAMES, EngineConfig, torch_dtype
from rebar.engine.scheduler import SchedulerConfig
from rebar.errors import ConfigError


@pytest.mark.parametrize(
    ("values", "key", "allowed"),
    [
        ({"block_size": 0}, "engine.block_size", "an integer >= 1"),
        ({"block_size": 16.0}, "engine.block_size", "an integer >= 1"),
        ({"max_num_seqs": True}, "engine.max_num_seqs", "an integer >= 1"),
        ({"max_model_len": 1}, "engine.max_model_len", "an integer >= 2 or None (unset)"),
        ({"kv_cache_memory": 0}, "engine.kv_cache_memory", "an integer > 0 or None (unset)"),
        ({"kv_cache_fraction": 1.5}, "engine.kv_cache_fraction", "a number > 0.0 and <= 1.0"),
        ({"kv_cache_fraction": "0.5"}, "engine.kv_cache_fraction", "a number > 0.0 and <= 1.0"),
        ({"enable_prefix_caching": 1}, "engine.enable_prefix_caching", "True or False"),
        ({"attention_backend": 3}, "engine.attention_backend", "a string or None (unset)"),
        ({"block_size": None}, "engine.block_size", "an integer >= 1"),
    ],
)
def test_invalid_values_raise_config_error_naming_the_setting(values, key, allowed) -> None:
    with pytest.raises(ConfigError) as caught:
        EngineConfig(**values)
    message = str(caught.value)
    assert key in message and repr(next(iter(values.values()))) in message
    assert message.endswith(f"allowed: {allowed}")


def test_unknown_kv_cache_dtype_is_refused_with_the_valid_names() -> None:
    with pytest.raises(ConfigError) as caught:
        EngineConfig(kv_cache_dtype="int8")
    assert "engine.kv_cache_dtype = 'int8'" in str(caught.value)
    assert "one of 'auto', 'float32', 'float16', 'bfloat16'" in str(caught.value)


def test_valid_values_are_kept() -> None:
    config = EngineConfig(
        block_size=8, max_model_len=None, kv_cache_fraction=1, kv_cache_dtype="bfloat16"
    )
    assert (config.block_size, config.max_model_len, config.kv_cache_fraction) == (8, None, 1)
    assert config.kv_dtype(torch.float32, torch.device("cpu")) == torch.bfloat16


def test_every_dtype_name_is_a_torch_dtype() -> None:
    for name in DTYPE_NAMES:
        assert torch_dtype(name).is_floating_point
        config = EngineConfig(kv_cache_dtype=name)
        assert config.kv_dtype(torch.float32, torch.device("cpu")) == getattr(torch, name)


def test_scheduler_config_checks_the_engine_settings_it_shares() -> None:
    assert SchedulerConfig.of(EngineConfig(max_num_seqs=3, max_num_batched_tokens=64)) == (
        SchedulerConfig(3, 64)
    )
    with pytest.raises(ConfigError, match=r"engine\.max_num_batched_tokens = 0"):
        SchedulerConfig(4, 0)
    assert SchedulerConfig() == SchedulerConfig.of(EngineConfig())  # the same defaults


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
    from rebar.engine.llm import LLM

    with pytest.raises(ConfigError, match=named):
        LLM(model="/no/such/model.gguf", **kwargs)
