"""Structured output on the stacks of 2026 (issue 42 item 5): a tiny gpt-oss (sinks, alternating
windows, experts) and Gemma 2 (soft-caps, sandwich norms) written by transformers
with the real Qwen vocabulary and tokenizer: sampled outputs under a JSON schema, a regex and a
choice are valid, past the sliding window, in a batch with unconstrained requests."""

from __future__ import annotations

import json
import re
import shutil

import jsonschema
import pytest

from hf_models import make_hf_model
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.default_model import ensure_default_model
from jaxserve.entrypoints.llm import LLM
from jaxserve.structured import StructuredOutputs

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
CODE = r"[A-Z]{2}-[0-9]{2,4}"
CHOICES = ["alpha", "beta", "gamma delta"]
VOCAB = 151_936  # the Qwen tokenizer's


@pytest.mark.parametrize("family", ["gpt_oss", "gemma2"])
def test_constrained_outputs_are_valid_on_sliding_window_stacks(family, tmp_path):
    path, _ = make_hf_model(family, tmp_path / family, vocab_size=VOCAB, bos_token_id=151643,
                            eos_token_id=151645, pad_token_id=151643)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ensure_default_model() / name, path / name)
    llm = LLM(str(path), show_progress=False, max_num_seqs=16, max_num_batched_tokens=64, max_model_len=256,
              token_buckets=(16, 64), seq_buckets=(16,), num_kv_pages=256, page_size=4, warmup="full")
    assert llm.core.model_cfg.kv_groups.num_groups > 1  # its sliding layers keep only their window
    s = StructuredOutputs
    requests = [
        ("Give me a person.", SamplingParams(n=4, temperature=1.0, top_k=50, seed=7, max_tokens=48,
                                             structured_outputs=s(json=PERSON))),
        ("A code:", SamplingParams(n=4, temperature=1.0, top_k=50, seed=9, max_tokens=16,
                                   structured_outputs=s(regex=CODE))),
        ("Pick one", SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=10, structured_outputs=s(choice=CHOICES))),
        ("Once upon a time", SamplingParams(temperature=1.0, top_k=50, seed=8, max_tokens=24, ignore_eos=True)),
    ]
    out = llm.generate([p for p, _ in requests], [q for _, q in requests])
    people, codes, picks, free = out
    for sample in people.outputs:
        assert sample.finish_reason == "stop", sample.text
        jsonschema.validate(json.loads(sample.text), PERSON)
    assert any(len(sample.token_ids) > 8 for sample in people.outputs)  # past the window of 8
    for sample in codes.outputs:
        assert re.fullmatch(CODE, sample.text), sample.text
    assert all(sample.text in CHOICES for sample in picks.outputs)
    assert len(free.outputs[0].token_ids) == 24
    assert llm.core.runner.compilations_after_warmup == 0
