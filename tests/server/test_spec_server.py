"""Speculative decoding behind the OpenAI API: a server started with an n-gram speculative config
streams what the plain server streams (greedy and seeded, stop strings inside accepted runs
included), and /metrics counts drafts and accepted tokens in vLLM's spec_decode shape."""

from __future__ import annotations

import pytest

from jaxserve.core.config import EngineConfig
from server_utils import MODEL, TEST_ENGINE, client_for, start_server

SPEC = {"method": "ngram", "num_speculative_tokens": 4}


@pytest.fixture(scope="module")
def servers(loaded_model):
    from jaxserve.engine.loading import load_engine_core

    spec_model = load_engine_core(None, EngineConfig(model_id=MODEL, speculative_config=SPEC, **TEST_ENGINE))
    spec, plain = start_server(spec_model), start_server(loaded_model)
    yield spec, plain
    spec.stop()
    plain.stop()


def _completions(server, **kw):
    client = client_for(server)
    out = []
    for prompt, extra in (("one two three one two three one two", dict(temperature=0.0)),
                          ("Hello", dict(temperature=0.8, top_p=0.9, seed=4)),
                          ("abc abc abc", dict(temperature=0.0, stop=[" the"]))):
        text = "".join(c.choices[0].text for c in client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=48, stream=True, **extra, **kw))
        out.append(text)
    return out


def test_streams_equal_the_plain_server_and_metrics_count_drafts(servers):
    spec, plain = servers
    assert _completions(spec) == _completions(plain)
    m = spec.wait_idle()
    drafts = m["jaxserve:spec_decode_num_drafts_total"]
    proposed = m["jaxserve:spec_decode_num_draft_tokens_total"]
    accepted = m["jaxserve:spec_decode_num_accepted_tokens_total"]
    assert drafts > 0 and 0 < accepted <= proposed <= 4 * drafts
    per_pos = [m[f"jaxserve:spec_decode_num_accepted_tokens_per_pos_total{{position={i}}}"] for i in range(4)]
    assert sum(per_pos) == accepted and per_pos == sorted(per_pos, reverse=True)
    assert m["jaxserve:compilations_after_warmup_total"] == 0
    assert "jaxserve:spec_decode_num_drafts_total" not in plain.metrics()
