"""Sampling values are checked where they enter the engine: finite, in range, named when refused."""

import math

import pytest
import torch

from prefixcache.engine.sampling_params import (
    GREEDY_TEMPERATURE,
    MAX_SEED,
    MIN_SEED,
    InvalidParameter,
    SamplingParams,
)

NAN, INF = math.nan, math.inf
BAD = [
    ("max_tokens", 0),
    ("max_tokens", True),
    ("max_tokens", 1.5),
    ("temperature", -1.0),
    ("temperature", NAN),
    ("temperature", INF),
    ("temperature", "1"),
    ("top_p", 0.0),
    ("top_p", NAN),
    ("top_p", 1.01),
    ("top_k", -1),
    ("top_k", 2.0),
    ("top_k", 2**31),
    ("seed", MAX_SEED + 1),
    ("seed", MIN_SEED - 1),
    ("seed", 1.0),
    ("presence_penalty", 2.01),
    ("presence_penalty", NAN),
    ("frequency_penalty", -INF),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("repetition_penalty", INF),
    ("logprobs", 21),
    ("logprobs", -1),
    ("prompt_logprobs", 21),
    ("stop", ("",)),
    ("stop", ("x" * 513,)),
    ("stop", tuple(str(i) for i in range(33))),
    ("stop_token_ids", (-1,)),
    ("stop_token_ids", tuple(range(1025))),
    ("min_p", -0.1),
    ("min_p", 1.5),
    ("min_p", NAN),
    ("min_tokens", -1),
    ("min_tokens", 17),  # beyond max_tokens (16)
    ("min_tokens", True),
    ("skip_special_tokens", 1),
    ("spaces_between_special_tokens", None),
    ("truncate_prompt_tokens", 0),
    ("truncate_prompt_tokens", -2),
    ("truncate_prompt_tokens", 2**31),
]


@pytest.mark.parametrize(("name", "value"), BAD, ids=[f"{n}={str(v)[:12]}" for n, v in BAD])
def test_out_of_range_values_are_refused_naming_the_field(name, value):
    with pytest.raises(InvalidParameter) as refused:
        SamplingParams(**{name: value})
    assert refused.value.param == name
    assert name in str(refused.value)


def test_temperatures_below_the_threshold_are_greedy():
    assert SamplingParams(temperature=1e-38).greedy
    assert SamplingParams(temperature=GREEDY_TEMPERATURE / 2).temperature == 0.0
    assert not SamplingParams(temperature=GREEDY_TEMPERATURE).greedy


def test_the_seed_range_is_exactly_what_torch_accepts():
    for seed in (MIN_SEED, -1, 0, MAX_SEED):
        torch.Generator().manual_seed(SamplingParams(seed=seed).seed)
    for seed in (MIN_SEED - 1, MAX_SEED + 1):
        with pytest.raises((RuntimeError, ValueError)):
            torch.Generator().manual_seed(seed)


def test_valid_extremes_are_accepted():
    params = SamplingParams(
        presence_penalty=-2,
        frequency_penalty=2,
        repetition_penalty=1e-3,
        logprobs=20,
        prompt_logprobs=0,
        stop=tuple("x" * 512 for _ in range(32)),
        top_k=2**31 - 1,
    )
    assert params.has_penalties
    assert params.stop_holdback == 511
