"""Multi-LoRA behind the OpenAI API: a PEFT adapter of the embedded default model is selected by the
request's `model` field and gives the merged transformers model's greedy text, the base model name
still gives the base model's, /v1/models lists the adapter with its parent, and an unknown name is
OpenAI's 404."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch
import transformers

from jaxserve.core.config import EngineConfig
from jaxserve.default_model import ensure_default_model
from peft_adapters import write_adapter
from server_utils import MODEL, TEST_ENGINE, client_for, start_server

PROMPT = [9707, 11, 1879, 0, 576, 3974, 13876, 38835]  # "Hello, world! The quick brown fox" in Qwen ids
NEW = 10


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory):
    from jaxserve.engine.loading import load_engine_core

    base_dir = ensure_default_model()
    hf = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()

    def greedy(model):
        with torch.no_grad():
            out = model.generate(input_ids=torch.tensor([PROMPT]), attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long),
                                 do_sample=False, max_new_tokens=NEW, min_new_tokens=NEW, eos_token_id=None,
                                 pad_token_id=0)
        return out[0, len(PROMPT):].tolist()

    expected = {MODEL: greedy(hf)}
    adapter_dir = tmp_path_factory.mktemp("adapter")
    expected["ad"] = greedy(write_adapter(hf, adapter_dir, seed=5, r=8).merge_and_unload())
    late_dir = tmp_path_factory.mktemp("late")
    fresh = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    expected["late"] = greedy(write_adapter(fresh, late_dir, seed=6, r=4).merge_and_unload())
    cfg = EngineConfig(model_id=MODEL, enable_lora=True, lora_modules=(("ad", str(adapter_dir)),), max_loras=2,
                       max_lora_rank=8, **TEST_ENGINE)
    server = start_server(load_engine_core(None, cfg), allow_runtime_lora_updating=True, vllm_metric_names=True)
    server.late_dir = late_dir
    yield server, expected
    server.stop()


def test_the_model_field_selects_the_adapter(lora_server):
    server, expected = lora_server
    client = client_for(server)
    texts = {}
    for name in (MODEL, "ad"):
        out = client.completions.create(model=name, prompt=PROMPT, max_tokens=NEW, temperature=0.0,
                                        extra_body={"ignore_eos": True})
        texts[name] = out.choices[0].text
    tok = server.state.tokenizer
    assert texts == {name: tok.decode(expected[name]) for name in texts}
    assert texts[MODEL] != texts["ad"]
    models = {m["id"]: m for m in httpx.get(f"{server.url}/v1/models").json()["data"]}
    assert models["ad"]["parent"] == MODEL and models["ad"]["root"].endswith("adapter0")
    with pytest.raises(openai.NotFoundError, match="'nope' does not exist.*jaxserve-tiny, ad"):
        client.completions.create(model="nope", prompt="x", max_tokens=2)
    m = server.wait_idle()
    assert m["jaxserve:compilations_after_warmup_total"] == 0
    assert m["jaxserve:lora_slot_loads_total"] == 1
    assert m["jaxserve:lora_num_requests_running{lora_name=ad}"] == 0
    assert m["jaxserve:lora_num_requests_waiting{lora_name=ad}"] == 0
    assert m["jaxserve:lora_requests_info{max_lora=2,running_lora_adapters=,waiting_lora_adapters=}"] == 1
    # --vllm-metric-names: what a gateway's endpoint picker scrapes, under vLLM's names
    for name in ("num_requests_waiting", "num_requests_running", "kv_cache_usage_perc"):
        assert m[f"vllm:{name}"] == m[f"jaxserve:{name}"], name
    (info,) = [k for k in m if k.startswith("vllm:cache_config_info{")]
    assert f"block_size={server.state.core.engine_cfg.page_size}" in info
    assert f"num_gpu_blocks={int(m['jaxserve:num_kv_pages_total'])}" in info
    (lora,) = [k for k in m if k.startswith("vllm:lora_requests_info{")]
    assert lora == "vllm:lora_requests_info{max_lora=2,running_lora_adapters=,waiting_lora_adapters=}"
    assert m[lora] > 1.7e9  # the report's time, as vLLM values it


def _post(server, path, body):
    return httpx.post(f"{server.url}{path}", json=body, timeout=60)


def test_adapters_load_and_unload_at_run_time(lora_server):
    server, expected = lora_server
    client = client_for(server)
    r = _post(server, "/v1/load_lora_adapter", {"lora_name": "late", "lora_path": str(server.late_dir)})
    assert r.status_code == 200 and "late" in r.text
    out = client.completions.create(model="late", prompt=PROMPT, max_tokens=NEW, temperature=0.0,
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].text == server.state.tokenizer.decode(expected["late"])
    assert "late" in {m["id"] for m in httpx.get(f"{server.url}/v1/models").json()["data"]}
    for body, status, words in (({"lora_name": "late", "lora_path": str(server.late_dir)}, 400, "already loaded"),
                                ({"lora_name": "x", "lora_path": "/nonexistent"}, 400, "does not exist"),
                                ({"lora_name": "x"}, 400, "'lora_path' must be a non-empty string")):
        r = _post(server, "/v1/load_lora_adapter", body)
        assert r.status_code == status and words in r.json()["error"]["message"], r.text
    # unloading an adapter with a request in flight is refused; once it has finished, it goes
    stream = client.completions.create(model="late", prompt=PROMPT, max_tokens=200, temperature=0.0, stream=True,
                                       extra_body={"ignore_eos": True})
    next(iter(stream))
    r = _post(server, "/v1/unload_lora_adapter", {"lora_name": "late"})
    assert r.status_code == 400 and "running or waiting" in r.json()["error"]["message"]
    assert sum(1 for _ in stream) > 0
    assert _post(server, "/v1/unload_lora_adapter", {"lora_name": "late"}).status_code == 200
    assert _post(server, "/v1/unload_lora_adapter", {"lora_name": "late"}).status_code == 404
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="late", prompt="x", max_tokens=2)
    assert "late" not in {m["id"] for m in httpx.get(f"{server.url}/v1/models").json()["data"]}
    assert server.wait_idle()["jaxserve:compilations_after_warmup_total"] == 0
