"""SamplingParams: every invalid value raises InvalidRequestError naming the parameter."""

from __future__ import annotations

import pytest

from rebar import SamplingParams
from rebar.errors import InvalidRequestError


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"seed": -1}, "seed"),
        ({"stop": ("",)}, "stop"),
        ({"stop": tuple(str(i) for i in range(17))}, "stop"),
        ({"stop_token_ids": (-1,)}, "stop_token_ids"),
    ],
)
def test_invalid_values_name_the_parameter(kwargs: dict, param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param
    assert param.split("_")[0] in str(info.value)


def test_single_stop_string_becomes_a_tuple() -> None:
    assert SamplingParams(stop="###").stop == ("###",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")


def test_greedy_means_temperature_zero() -> None:
    assert SamplingParams(temperature=0).greedy
    assert not SamplingParams(temperature=0.5).greedy
