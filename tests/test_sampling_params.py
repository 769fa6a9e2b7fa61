"""SamplingParams.validate: every out-of-range field raises a ValueError that names it."""

import math
import pathlib
import subprocess
import sys

import pytest

from jaxserve.core.sampling_params import MAX_LOGIT_BIAS, SamplingParams

VOCAB = 1000


@pytest.mark.parametrize("field,kwargs", [
    ("n", {"n": 0}),
    ("n", {"n": 65}),
    ("n", {"n": 2.0}),
    ("temperature", {"temperature": -0.1}),
    ("temperature", {"temperature": 100.5}),
    ("temperature", {"temperature": math.nan}),
    ("temperature", {"temperature": math.inf}),
    ("top_p", {"top_p": 0.0}),
    ("top_p", {"top_p": 1.01}),
    ("top_p", {"top_p": math.nan}),
    ("top_k", {"top_k": -2}),
    ("min_p", {"min_p": -0.01}),
    ("min_p", {"min_p": 1.5}),
    ("repetition_penalty", {"repetition_penalty": 0.0}),
    ("repetition_penalty", {"repetition_penalty": -1.0}),
    ("repetition_penalty", {"repetition_penalty": math.inf}),
    ("presence_penalty", {"presence_penalty": 2.1}),
    ("presence_penalty", {"presence_penalty": -2.1}),
    ("frequency_penalty", {"frequency_penalty": 2.5}),
    ("frequency_penalty", {"frequency_penalty": -3.0}),
    ("logit_bias", {"logit_bias": {VOCAB: 1.0}}),
    ("logit_bias", {"logit_bias": {-1: 1.0}}),
    ("logit_bias", {"logit_bias": {3: 100.5}}),
    ("logit_bias", {"logit_bias": {3: -101.0}}),
    ("logit_bias", {"logit_bias": {3: math.nan}}),
    ("logit_bias", {"logit_bias": {"3": 1.0}}),
    ("logit_bias", {"logit_bias": {i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)}}),
    ("seed", {"seed": 2**63}),
    ("seed", {"seed": -(2**63) - 1}),
    ("max_tokens", {"max_tokens": 0}),
    ("min_tokens", {"min_tokens": -1}),
    ("min_tokens", {"min_tokens": 17, "max_tokens": 16}),
    ("logprobs", {"logprobs": -1}),
    ("logprobs", {"logprobs": 21}),
    ("stop", {"stop": [""]}),
    ("stop", {"stop": ["x"] * 17}),
    ("stop", {"stop": "x"}),
    ("stop_token_ids", {"stop_token_ids": [VOCAB]}),
    ("stop_token_ids", {"stop_token_ids": [-1]}),
    ("ignore_eos", {"ignore_eos": 1}),
    ("skip_special_tokens", {"skip_special_tokens": "yes"}),
])
def test_invalid_field_raises_value_error_naming_it(field, kwargs):
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        SamplingParams(**kwargs).validate(VOCAB)


@pytest.mark.parametrize("kwargs", [
    {},
    {"temperature": 0.0, "top_p": 1.0, "top_k": -1},
    {"temperature": 100.0, "top_k": 0, "min_p": 1.0},
    {"n": 64, "top_k": 10_000, "repetition_penalty": 1e-3},
    {"presence_penalty": -2.0, "frequency_penalty": 2.0},
    {"logit_bias": {i: (-100.0 if i % 2 else 100) for i in range(MAX_LOGIT_BIAS)}},
    {"seed": 2**63 - 1}, {"seed": -(2**63)},
    {"max_tokens": None, "min_tokens": 1000},
    {"max_tokens": 5, "min_tokens": 5},
    {"logprobs": 0}, {"logprobs": 20},
    {"stop": ["a"] * 16, "stop_token_ids": [0, VOCAB - 1]},
])
def test_valid_params_pass(kwargs):
    SamplingParams(**kwargs).validate(VOCAB)


def test_defaults_match_contract():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, -1, 0.0)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0)
    assert p.logit_bias is None and p.seed is None and p.logprobs is None
    assert (p.max_tokens, p.min_tokens, p.ignore_eos, p.skip_special_tokens) == (16, 0, False, True)
    assert p.stop == [] and p.stop_token_ids == []
    assert SamplingParams().stop is not p.stop  # no shared mutable default


def test_module_does_not_import_jax():
    code = "import sys, jaxserve.core.sampling_params; print('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=pathlib.Path(__file__).parents[1])
    assert out.stdout.strip() == "False"
