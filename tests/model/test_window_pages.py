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


def test_pages_shipped_between_engines_carry_every_groups_window(tmp_path):
    """PD on a stack of layer groups: a prefill engine exports a long prompt's cached pages (the
    full group's from the first page, each sliding group's from its window), a decode engine imports
    them and computes only the prompt's tail; its greedy tokens are transformers'."""
    path, model = make_hf_model("gpt_oss", tmp_path / "gpt_oss")  # sinks, window 8, experts: 3 groups
    cfg, weights = load_model(path, make_mesh(1, 1))
    prompt = list(range(3, 45))  # 42 tokens: 10 full pages
    prefill, decode = (make_core(cfg, weights, max_model_len=64) for _ in range(2))
    run_all(prefill, [Request("p", prompt, greedy(1))])

    def done(core, fut):
        while not fut.done():
            core.step()
        return fut.result()
    leaves = done(prefill, prefill.export_prefix(prompt))
    rows = leaves[0].shape[0]
    assert rows == prefill.allocator.export_rows(10) == 10 + 2 * 2  # each sliding group: pages 8 and 9
    assert done(decode, decode.import_prefix(prompt, None, rows, leaves)) == rows
    got = run_all(decode, [Request("d", prompt, greedy(12))])
    assert decode.num_prefill_tokens == len(prompt) - 40
    assert got["d"][0] == _hf_generate(model, [prompt], 12)[0]


def test_window_pages_pushed_to_the_host_tier_come_back(tmp_path):
    """A long prompt's cached pages, every group's, pushed out of a 40-page pool by four others,
    come back from the host tier when it is sent again: its 40 cached tokens are a hit (the full
    group's 10 pages and each sliding group's last 2) and the tokens are transformers'."""
    path, model = make_hf_model("gemma3", tmp_path / "gemma3")
    cfg, weights = load_model(path, make_mesh(1, 1))
    first = [(i * 7) % 90 + 3 for i in range(41)]
    others = [[(i * 13 + k * 5) % 90 + 3 for i in range(41)] for k in range(4)]
    core = make_core(cfg, weights, num_kv_pages=40, max_model_len=64, kv_offload_gib=0.001)
    for i, prompt in enumerate([first, *others]):
        run_all(core, [Request(f"r{i}", prompt, greedy(6))])
    before = core.num_prefill_tokens
    got = run_all(core, [Request("again", first, greedy(6))])
    stats = core.stats()
    assert core.num_prefill_tokens - before == 1 and stats.host_hit_tokens == 40
    assert stats.num_promotions == 10 + 2 * 2
    assert got["again"][0] == _hf_generate(model, [first], 6)[0]
    core.allocator.check_invariants()
