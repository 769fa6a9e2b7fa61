"""--generation-config: the model's generation_config.json gives the sampling defaults of requests
that leave them out (vLLM's `auto`), `vllm` keeps OpenAI's, a directory brings its own; what a
request sends always wins."""

from __future__ import annotations

import json

import pytest
from server_utils import MODEL, client_for, start_server

from jaxserve.entrypoints import cli
from jaxserve.server.protocol import ModelContext, parse_completion
from jaxserve.text.generation_config import sampling_defaults


def write_config(directory, **fields):
    directory.mkdir(exist_ok=True)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "do_sample": True, **fields}))
    return directory


def test_auto_reads_the_sampling_fields_and_vllm_reads_none(tmp_path):
    model = write_config(tmp_path / "model", temperature=0.6, top_p=0.95, top_k=20, max_new_tokens=100)
    assert sampling_defaults(model) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    assert sampling_defaults(model, "vllm") == {}
    assert sampling_defaults(tmp_path / "no-config") == {}  # auto, and the model has none: OpenAI's
    other = write_config(tmp_path / "other", temperature=0.3, top_k=0)
    assert sampling_defaults(model, str(other)) == {"temperature": 0.3, "top_k": -1}  # 0: transformers' "all"
    with pytest.raises(ValueError, match="no generation_config.json there"):
        sampling_defaults(model, str(tmp_path / "no-config"))


def test_a_request_that_leaves_a_field_out_takes_the_default_and_one_that_sends_it_wins(loaded_model):
    tokenizer = loaded_model[1]
    ctx = ModelContext((MODEL,), 512, 151936, tokenizer, sampling_defaults={"temperature": 0.6, "top_k": 20})
    left_out = parse_completion({"model": MODEL, "prompt": "hi", "max_tokens": 2}, ctx).params
    assert (left_out.temperature, left_out.top_k, left_out.top_p) == (0.6, 20, 1.0)
    sent = parse_completion({"model": MODEL, "prompt": "hi", "max_tokens": 2, "temperature": 1.0, "top_k": -1},
                            ctx).params
    assert (sent.temperature, sent.top_k) == (1.0, -1)


def test_a_server_with_a_greedy_generation_config_answers_unseeded_requests_greedily(loaded_model, tmp_path):
    greedy = write_config(tmp_path / "greedy", temperature=0.0)
    live = start_server(loaded_model, generation_config=str(greedy))
    try:
        client = client_for(live)
        texts = [client.completions.create(model=MODEL, prompt="The sky is", max_tokens=6).choices[0].text
                 for _ in range(2)]
        explicit = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=6, temperature=0.0)
        sampled = {client.completions.create(model=MODEL, prompt="The sky is", max_tokens=6, temperature=1.0,
                                             seed=seed).choices[0].text for seed in (1, 2)}
    finally:
        live.stop()
    assert texts == [explicit.choices[0].text] * 2
    assert len(sampled) == 2  # a request's own temperature still wins


def test_a_generation_config_directory_without_the_file_is_refused_before_loading(tmp_path, capsys):
    assert cli.main(["serve", "--generation-config", str(tmp_path)]) == 2
    assert "no generation_config.json there" in capsys.readouterr().err
