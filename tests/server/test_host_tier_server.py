"""The host KV tier through the real server: a prompt pushed out of a small device pool comes back
from host memory, and /metrics says so."""

from __future__ import annotations

import pytest

from server_utils import MODEL, client_for, start_server


@pytest.fixture(scope="module")
def tier_server():
    from jaxserve.core.config import EngineConfig
    from jaxserve.engine.loading import load_engine_core

    cfg = EngineConfig(model_id=MODEL, num_kv_pages=24, max_model_len=256, max_num_seqs=2,
                       max_num_batched_tokens=256, kv_offload_gib=0.05)
    server = start_server(load_engine_core(None, cfg))
    yield server
    server.stop()


def test_a_prompt_evicted_from_the_device_is_served_from_the_host_tier(tier_server):
    client = client_for(tier_server)
    words = ["alpha", "bravo", "charlie", "delta", "echo"]
    prompts = [" ".join(f"{w}{i}" for i in range(60)) for w in words]
    first = client.completions.create(model=MODEL, prompt=prompts[0], max_tokens=4, temperature=0.0)
    for p in prompts[1:]:  # each ~4/5 of the pool: the first prompt's pages are demoted
        client.completions.create(model=MODEL, prompt=p, max_tokens=4, temperature=0.0)
    before = tier_server.metrics()
    again = client.completions.create(model=MODEL, prompt=prompts[0], max_tokens=4, temperature=0.0)
    m = tier_server.metrics()
    assert again.choices[0].text == first.choices[0].text
    assert m["jaxserve:kv_host_pages_total"] > 0 and before["jaxserve:kv_demoted_pages_total"] > 0
    hits = m["jaxserve:kv_host_hit_tokens_total"] - before["jaxserve:kv_host_hit_tokens_total"]
    assert hits >= 160 and m["jaxserve:kv_promoted_pages_total"] >= 10
    assert m["jaxserve:compilations_after_warmup_total"] == 0
