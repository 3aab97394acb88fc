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


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"n": 0}, "n"),
        ({"n": 17}, "n"),
        ({"n": True}, "n"),
        ({"n": 2.0}, "n"),
        ({"top_k": True}, "top_k"),
        ({"logprobs": True}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": 1.0}, "logprobs"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"repetition_penalty": 2.01}, "repetition_penalty"),
        ({"repetition_penalty": NAN}, "repetition_penalty"),
        ({"repetition_penalty": INF}, "repetition_penalty"),
        ({"presence_penalty": 2.01}, "presence_penalty"),
        ({"presence_penalty": -2.01}, "presence_penalty"),
        ({"presence_penalty": NAN}, "presence_penalty"),
        ({"presence_penalty": -INF}, "presence_penalty"),
        ({"frequency_penalty": 2.01}, "frequency_penalty"),
        ({"frequency_penalty": -2.01}, "frequency_penalty"),
        ({"frequency_penalty": NAN}, "frequency_penalty"),
        ({"frequency_penalty": "0.5"}, "frequency_penalty"),
        ({"logit_bias": {5: 100.5}}, "logit_bias"),
        ({"logit_bias": {5: -101}}, "logit_bias"),
        ({"logit_bias": {5: NAN}}, "logit_bias"),
        ({"logit_bias": {5: INF}}, "logit_bias"),
        ({"logit_bias": {5: "1"}}, "logit_bias"),
        ({"logit_bias": {5: True}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {"-1": 1.0}}, "logit_bias"),
        ({"logit_bias": {"abc": 1.0}}, "logit_bias"),
        ({"logit_bias": {"1.5": 1.0}}, "logit_bias"),
        ({"logit_bias": {"": 1.0}}, "logit_bias"),
        ({"logit_bias": {2.0: 1.0}}, "logit_bias"),
        ({"logit_bias": {True: 1.0}}, "logit_bias"),
        ({"logit_bias": {"5": 1.0, 5: 2.0}}, "logit_bias"),
        ({"logit_bias": [(5, 1.0)]}, "logit_bias"),
        ({"temperature": INF}, "temperature"),
        ({"temperature": 10**400}, "temperature"),  # too large for a float
        ({"logit_bias": {5: -(10**400)}}, "logit_bias"),
        ({"temperature": "1"}, "temperature"),
        ({"top_p": NAN}, "top_p"),
        ({"min_p": NAN}, "min_p"),
        ({"stop_token_ids": (True,)}, "stop_token_ids"),
        ({"ignore_eos": 1}, "ignore_eos"),
    ],
)
def test_invalid_new_values_name_the_parameter(kwargs: dict, param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param
    assert param.split("_")[0] in str(info.value)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"n": 1},
        {"n": 16},
        {"repetition_penalty": 2.0},
        {"repetition_penalty": 0.01},
        {"presence_penalty": -2.0, "frequency_penalty": 2},
        {"logit_bias": {0: -100, 7: 100.0}},
        {"logprobs": 0},
        {"logprobs": 20},
        {"temperature": 0, "top_k": 5},
    ],
)
def test_boundary_values_are_accepted(kwargs: dict) -> None:
    params = SamplingParams(**kwargs)
    for name, value in kwargs.items():
        if name == "logit_bias":  # kept with int ids and float biases
            assert params.logit_bias == {int(k): float(v) for k, v in value.items()}
        else:
            assert getattr(params, name) == value, name


def test_new_fields_default_to_off() -> None:
    params = SamplingParams()
    assert params.n == 1 and params.repetition_penalty == 1.0
    assert params.presence_penalty == 0.0 and params.frequency_penalty == 0.0
    assert params.logit_bias is None and params.logprobs is None
    assert not params.has_penalties


def test_logit_bias_accepts_decimal_string_keys() -> None:
    bias = SamplingParams(logit_bias={"5": 1.5, "12": -2, 3: 100}).logit_bias
    assert bias == {3: 100.0, 5: 1.5, 12: -2.0}
    assert all(type(k) is int for k in bias) and all(type(v) is float for v in bias.values())
    assert list(bias) == [3, 5, 12]


def test_logit_bias_is_immutable_and_params_stay_hashable() -> None:
    a = SamplingParams(logit_bias={"5": 1.0, 2: -1.0})
    b = SamplingParams(logit_bias={2: -1, 5: 1})
    assert a == b and hash(a) == hash(b)
    with pytest.raises(TypeError):
        a.logit_bias[5] = 3.0  # type: ignore[index]
    source = {1: 2.0}
    c = SamplingParams(logit_bias=source)
    source[1] = 50.0
    assert c.logit_bias == {1: 2.0}


def test_empty_logit_bias_means_none() -> None:
    assert SamplingParams(logit_bias={}).logit_bias is None


def test_check_vocab_names_the_offending_field() -> None:
    SamplingParams(logit_bias={99: 1.0}, stop_token_ids=(99,)).check_vocab(100)
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(logit_bias={3: 1.0, 100: 1.0}).check_vocab(100)
    assert info.value.param == "logit_bias" and "100" in str(info.value)
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(stop_token_ids=(1, 250)).check_vocab(100)
    assert info.value.param == "stop_token_ids" and "250" in str(info.value)


def test_child_params_have_n_one_and_distinct_seeds() -> None:
    params = SamplingParams(n=3, seed=10, temperature=0.7)
    children = [params.child(i) for i in range(3)]
    assert [c.seed for c in children] == [10, 11, 12]
    assert all(c.n == 1 and c.temperature == 0.7 for c in children)
    assert SamplingParams(n=2).child(1).seed is None
    assert SamplingParams(n=2, seed=2**63 - 1).child(1).seed == 0
    with pytest.raises(IndexError):
        params.child(3)


@pytest.mark.parametrize("temperature", [1e-50, 5e-324, 1e-6, 9.99e-6])
def test_a_temperature_too_small_to_divide_by_is_greedy(temperature: float) -> None:
    params = SamplingParams(temperature=temperature, top_k=5, seed=3)
    assert params.temperature == 0.0 and params.greedy
    assert SamplingParams(temperature=1e-5).temperature == 1e-5  # the smallest one that samples


@pytest.mark.parametrize("penalty", [1e-50, 5e-324, 0.0099])
def test_a_repetition_penalty_that_could_overflow_the_logits_is_refused(penalty: float) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(repetition_penalty=penalty)
    assert info.value.param == "repetition_penalty" and "0.01" in str(info.value)


def test_stop_strings_have_a_generous_length_cap() -> None:
    SamplingParams(stop=["x" * 4096] * 16)
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(stop=["ok", "x" * 4097])
    assert info.value.param == "stop" and "4096" in str(info.value)
