"""Sliding layers keep only their window (issue 42 item 3), on the engine: in the same pool bytes a
stack of sliding and full layers runs more sequences at once than when every layer keeps every
page, and the tokens stay transformers' greedy ones while released pages are reused by others."""

from __future__ import annotations

import dataclasses

from checkpoints import load_model
from engine_utils import greedy, make_core, run_all
from hf_models import make_hf_model
from jaxserve.core.request import Request
from jaxserve.parallel.sharding import make_mesh

from test_parity import _hf_generate

# 6 sequences of 10 + 50 tokens (window 8, pages of 4): 15 pages each in every group they keep whole
PROMPTS = [[7 + i, 30 + 2 * i, 11, 5 + i, 60 - i, 3, 9 + i, 41, 2 * i + 1, 17] for i in range(6)]


def _run(core, requests):
    """(tokens, sequences running in each step)."""
    running = []
    got = run_all(core, requests, on_step=lambda: running.append(core.stats().num_running))
    return got, running


def test_same_pool_bytes_hold_more_sequences_and_tokens_equal_generate(tmp_path):
    path, model = make_hf_model("gemma3", tmp_path / "gemma3")  # sliding, full, sliding
    cfg, weights = load_model(path, make_mesh(1, 1))
    assert cfg.kv_groups.windows == (None, 8, 8) and cfg.kv_groups.num_arrays == 1
    kept = dataclasses.replace(cfg, single_kv_group=True)  # every layer keeps every page
    assert kept.kv_groups.num_arrays == 3
    # 48 pages of one layer, or 16 pages of three: the same bytes
    grouped = make_core(cfg, weights, num_kv_pages=48, max_model_len=64)
    whole = make_core(kept, weights, num_kv_pages=16, max_model_len=64)
    assert sum(x.nbytes for x in grouped.runner.kv.k) == sum(x.nbytes for x in whole.runner.kv.k)
    requests = lambda: [Request(f"r{i}", p, greedy(50)) for i, p in enumerate(PROMPTS)]  # noqa: E731
    got, running = _run(grouped, requests())
    got_whole, running_whole = _run(whole, requests())
    expected = [_hf_generate(model, [p], 50)[0] for p in PROMPTS]
    assert [got[f"r{i}"][0] for i in range(6)] == expected
    assert [got_whole[f"r{i}"][0] for i in range(6)] == expected
    # 16 pages of three layers hold one sequence of 60 tokens (15 pages); 48 pages of one layer hold
    # 15 full-group pages and at most 2 x 4 window pages per sequence: about two. Measured: 2.43
    # sequences per step on average against 1.37, 125 steps against 222.
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    assert mean(running) > 1.5 * mean(running_whole) and len(running) < 0.7 * len(running_whole)
    assert grouped.runner.compilations_after_warmup == 0
