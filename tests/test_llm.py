"""The offline API on the embedded default model (real Qwen tokenizer, random weights)."""

from __future__ import annotations

import pytest

from jaxserve.llm import LLM
from jaxserve.sampling_params import SamplingParams

ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128, token_buckets=(32,),
              seq_buckets=(4,), num_kv_pages=64)


@pytest.fixture(scope="module")
def llm():
    return LLM(**ENGINE)


def test_generate_text_prompts_greedy_is_deterministic_and_batched_equals_alone(llm):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = ["Hello, world", "今天天气很好", "def f(x):\n    return"]
    together = llm.generate(prompts, params)
    alone = [llm.generate([p], params)[0] for p in prompts]
    for a, b in zip(together, alone):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids and len(a.outputs[0].token_ids) == 12
        assert a.outputs[0].text == llm.tokenizer.decode(a.outputs[0].token_ids)
        assert a.outputs[0].finish_reason == "length"


def test_stop_string_cuts_the_text_and_finishes_with_stop(llm):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    full = llm.generate(["Once upon a time"], params)[0].outputs[0].text
    assert len(full) > 12
    stop = full[6:9]
    cut = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                          stop=[stop]))[0].outputs[0]
    assert cut.finish_reason == "stop"
    assert cut.text == full[: full.index(stop)]
    assert stop not in cut.text


def test_n_samples_logprobs_and_seeds(llm):
    params = SamplingParams(n=3, temperature=1.0, max_tokens=6, seed=11, logprobs=2, ignore_eos=True)
    first = llm.generate(["A"], params)[0]
    again = llm.generate(["A"], params)[0]
    assert [o.token_ids for o in first.outputs] == [o.token_ids for o in again.outputs]
    assert len({tuple(o.token_ids) for o in first.outputs}) == 3
    assert all(len(o.logprobs) == 6 and all(lp <= 0 for lp in o.logprobs) for o in first.outputs)


def test_bad_parameters_are_rejected_with_the_field_name(llm):
    with pytest.raises(ValueError, match="temperature"):
        llm.generate(["x"], SamplingParams(temperature=-1))
    with pytest.raises(ValueError, match="max_model_len|context"):
        llm.generate([[1] * 120], SamplingParams(max_tokens=50))
