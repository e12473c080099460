"""SamplingParams validation: every bad value raises a ValueError naming the field; API-style inputs convert."""

import math

import pytest

from astrai.inference.errors import EngineInputError
from astrai.inference.params import SAMPLING_EPS, SamplingParams


def test_defaults_and_edge_values_are_valid():
    SamplingParams().check(vocab_size=100)
    SamplingParams(
        max_tokens=1, temperature=0.0, top_p=1e-6, top_k=-1, min_p=1.0, frequency_penalty=-2.0, presence_penalty=2.0,
        repetition_penalty=1e-3, logit_bias={"99": -100, 0: 100}, seed=-(2**70), n=16, top_logprobs=20,
        stop=["x"] * 16, stop_token_ids=[0, 99], min_tokens=1,
    ).check(vocab_size=100)  # fmt: skip
    SamplingParams(logit_bias={10**6: 1.0}).check()  # ids are only range-checked against a known vocab


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", 0),
        ("max_tokens", 2.5),
        ("temperature", -0.1),
        ("temperature", math.nan),
        ("temperature", math.inf),
        ("top_p", 0.0),
        ("top_p", 1.01),
        ("top_p", math.nan),
        ("top_k", -2),
        ("top_k", 1.5),
        ("min_p", -0.01),
        ("min_p", 1.5),
        ("frequency_penalty", 2.5),
        ("presence_penalty", -2.01),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", math.nan),
        ("logit_bias", {5: 101.0}),
        ("logit_bias", {-1: 1.0}),
        ("logit_bias", {100: 1.0}),
        ("logit_bias", ((3, 1.0), (3, 2.0))),
        ("logit_bias", {"x": 1.0}),
        ("seed", 1.5),
        ("n", 0),
        ("n", 17),
        ("top_logprobs", 21),
        ("top_logprobs", -1),
        ("stop", [""]),
        ("stop", ["s"] * 17),
        ("stop_token_ids", (5, 100)),
        ("stop_token_ids", (-3,)),
        ("min_tokens", -1),
        ("min_tokens", 17),  # > max_tokens (16)
        ("max_tokens", True),
        # float32 underflow / overflow (issue 18): these became 0, subnormal or inf on the device -> NaN logits
        ("temperature", 1e39),
        ("top_p", 1e-300),
        ("min_p", 5e-324),
        ("frequency_penalty", 1e-45),
        ("presence_penalty", -1e-40),
        ("repetition_penalty", 5e-324),
        ("repetition_penalty", 1e-7),
        ("repetition_penalty", 1e7),
        ("logit_bias", {5: 1e-40}),
    ],
)
def test_bad_values_name_the_field(field, value):
    with pytest.raises(EngineInputError, match=field) as info:
        SamplingParams(**{field: value}).check(vocab_size=100)
    assert isinstance(info.value, ValueError) and info.value.param == field


@pytest.mark.parametrize("t", [0.0, 5e-324, 1e-45, 1e-39, 1e-20, SAMPLING_EPS / 2])
def test_temperatures_below_the_epsilon_are_greedy_not_errors(t):
    p = SamplingParams(temperature=t)
    p.check(vocab_size=100)
    assert p.greedy
    assert not SamplingParams(temperature=SAMPLING_EPS).greedy


def test_float32_edge_values_are_accepted():
    SamplingParams(repetition_penalty=1e-6, top_p=2.0**-126, min_p=2.0**-126, frequency_penalty=-(2.0**-126),
                   logit_bias={1: 2.0**-126}).check(vocab_size=100)  # fmt: skip
    SamplingParams(repetition_penalty=1e6, temperature=3e38).check(vocab_size=100)


def test_api_style_inputs_are_converted():
    p = SamplingParams(stop="###", logit_bias={"7": 3, 2: -1.5}, stop_token_ids=[4, 5])
    assert p.stop == ("###",)
    assert p.logit_bias == ((7, 3.0), (2, -1.5))
    assert p.stop_token_ids == (4, 5)
    assert hash(p) == hash(SamplingParams(stop=("###",), logit_bias=((7, 3.0), (2, -1.5)), stop_token_ids=(4, 5)))
    assert SamplingParams(top_logprobs=2).wants_logprobs and not SamplingParams().wants_logprobs
    assert SamplingParams(temperature=0).greedy and not SamplingParams().greedy


def test_top_logprobs_cannot_exceed_vocab():
    with pytest.raises(ValueError, match="top_logprobs"):
        SamplingParams(top_logprobs=8).check(vocab_size=5)
