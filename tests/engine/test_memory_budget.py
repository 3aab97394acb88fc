"""`LLM(memory_budget=...)`: the KV cache gets what the weights leave; a model that cannot fit is
refused with the numbers."""

from __future__ import annotations

import pytest

from markers import requires_smollm2
from rebar.errors import ConfigError

pytestmark = requires_smollm2
MiB = 2**20


def load(budget: int, max_model_len: int = 512):
    from rebar.llm import LLM

    return LLM("smollm2", max_model_len=max_model_len, memory_budget=budget)


def test_the_kv_cache_gets_what_the_weights_leave() -> None:
    llm = load(300 * MiB)
    assert llm.footprint_bytes <= 300 * MiB
    assert 300 * MiB - llm.footprint_bytes < 2 * MiB  # within a block's rounding of the budget
    assert llm.kv_cache_bytes > 64 * MiB


def test_weights_over_the_budget_are_refused_with_their_size() -> None:
    with pytest.raises(ConfigError) as caught:
        load(100 * MiB)
    message = str(caught.value)
    assert "its weights take 184" in message and "memory budget of 100.0 MiB" in message


def test_too_little_left_for_one_sequence_is_refused_with_the_numbers() -> None:
    with pytest.raises(ConfigError) as caught:
        load(190 * MiB, max_model_len=8192)
    message = str(caught.value)
    assert "a memory budget of 190.0 MiB leaves" in message
    assert "fewer than max_model_len=8192" in message
