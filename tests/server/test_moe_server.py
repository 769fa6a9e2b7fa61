"""A mixture of experts through the real server: a tiny Qwen3-MoE checkpoint written by
transformers with the Qwen tokenizer, served on 4 devices with expert parallelism (--layout tp-ep:
tokens dispatched to their experts by all-to-all), streamed with the official openai client; its
greedy text is the transformers model's, and nothing compiles after warm-up."""

from __future__ import annotations

import shutil

import pytest
import torch

from hf_models import make_hf_model
from server_utils import MODEL, client_for, start_server

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]


@pytest.fixture(scope="module")
def moe_server(tmp_path_factory):
    from jaxserve.default_model import ensure_default_model
    from jaxserve.engine.loading import load_engine_core
    from jaxserve.core.config import EngineConfig
    from jaxserve.text.tokenizer import Tokenizer

    tiny = ensure_default_model()
    vocab = Tokenizer.from_pretrained(tiny).vocab_size
    path, model = make_hf_model("qwen3-moe", tmp_path_factory.mktemp("moe"), vocab_size=vocab)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny / name, path / name)
    cfg = EngineConfig(model_id=MODEL, mesh_shape=(1, 4), layout="tp-ep", max_num_seqs=4,
                       max_num_batched_tokens=32, max_model_len=128, num_kv_pages=64)
    loaded = load_engine_core(path, cfg)
    assert loaded[0].runner._moe is not None  # the all-to-all block, not XLA's partitioning
    server = start_server(loaded)
    yield server, model, loaded[1]
    server.stop()


def test_moe_model_streams_the_transformers_greedy_text_with_no_compilation_after_warmup(moe_server):
    server, model, tokenizer = moe_server
    client = client_for(server)
    for prompt in PROMPTS:
        text = "".join(c.choices[0].text for c in client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=8, temperature=0.0, stream=True))
        ids = torch.tensor([tokenizer.encode(prompt)])
        with torch.no_grad():
            want = model.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1]:].tolist()
        assert text == tokenizer.decode(want), prompt
    assert server.metrics()["jaxserve:compilations_after_warmup_total"] == 0
