"""The offline API on the embedded default model (real Qwen tokenizer, random weights)."""

from __future__ import annotations

import io
import logging
import re

import pytest

from jaxserve.core.sampling_params import SamplingParams
from jaxserve.entrypoints import engine_args
from jaxserve.entrypoints.llm import LLM

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


def test_progress_bars_show_while_loading_and_compiling_unless_turned_off(capsys):
    LLM(show_progress=True, **ENGINE)
    err = capsys.readouterr().err
    assert "loading jaxserve-tiny" in err and "compiling" in err and "program" in err
    LLM(show_progress=False, **ENGINE)
    err = capsys.readouterr().err
    assert "loading" not in err and "compiling" not in err


def test_cli_generate_compiles_few_programs_and_prints_the_engines_greedy_text(llm, caplog):
    """`jaxserve generate` runs serve's engine with a background warm-up: it answers once the smallest
    bucket is compiled (the rest compiling meanwhile); the text must not change."""
    from jaxserve.entrypoints import cli
    from jaxserve.server import commands

    args = cli.build_parser().parse_args(["generate", "--prompt", "Hello"])
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    caplog.set_level(logging.INFO, logger="jaxserve.runner.warmup")
    out = io.StringIO()
    reason = commands.generate(None, engine_args.engine_config(args, "jaxserve-tiny"), "Hello", params, out=out,
                               show_progress=False)
    warmed = [int(m.group(1)) for r in caplog.records
              if (m := re.search(r"warm-up compiled (\d+) programs", r.getMessage()))]
    # The smallest bucket's forward, its sampler at every history width, the page copy
    assert len(warmed) == 1 and warmed[0] <= 7
    expected = llm.generate(["Hello"], params)[0].outputs[0]  # 4 sequences, 32-token steps
    assert reason == "length" and out.getvalue() == expected.text + "\n" and len(expected.token_ids) == 12
