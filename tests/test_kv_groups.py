"""KV layer groups (core/kv_groups.py) and the allocator's per-group tables: sliding layers keep
only their window's pages, in one pool, with the prefix cache, forks, the host tier and shipped
pages (PD) seeing every group (issue 42 item 3)."""

from __future__ import annotations

import pytest

from jaxserve.core.kv_groups import kv_groups, max_tokens, pages_to_hold
from jaxserve.engine.page_allocator import PageAllocator

PS = 4


def test_groups_of_alternating_and_five_to_one_stacks():
    oss = kv_groups((128, None) * 12)  # gpt-oss-20b: sliding first, then full, alternating
    assert oss.windows == (None, 128) and oss.num_arrays == 12
    assert oss.layer_group[:4] == (1, 0, 1, 0) and oss.layer_array[:4] == (0, 0, 1, 1)
    gemma3 = kv_groups(tuple(None if i % 6 == 5 else 1024 for i in range(62)))  # 10 full, 52 sliding
    assert gemma3.windows == (None,) + (1024,) * 6 and gemma3.num_arrays == 10
    assert [gemma3.layer_group.count(g) for g in range(7)] == [10, 10, 10, 10, 10, 10, 2]
    for g in range(7):  # within a group each layer has its own array
        arrays = [a for a, gg in zip(gemma3.layer_array, gemma3.layer_group) if gg == g]
        assert len(arrays) == len(set(arrays))
    uniform = kv_groups((None,) * 5)
    assert uniform.windows == (None,) and uniform.layer_array == (0, 1, 2, 3, 4)
    assert kv_groups((8,) * 3).windows == (8,)  # sliding on every layer (Phi-3): one group


def test_a_sequence_holds_its_window_not_its_context():
    windows = (None, 128)
    # 32k tokens in chunks of 512, pages of 16: 2048 full-group pages, (127 + 512) / 16 + 1 sliding
    assert pages_to_hold(windows, 32768, 16, 512) == 2048 + 40 + 1
    assert pages_to_hold((None,), 32768, 16, 512) == 2048
    assert pages_to_hold((128,), 20, 16, 512) == 2  # never more than the context's pages
    assert max_tokens((None, 128), 2089, 16, 512, 10 ** 6) == 32768
    assert max_tokens((128,), 41, 16, 512, 10 ** 6) == 10 ** 6  # the window bounds it, not the pool


def _alloc(pages: int = 64, windows=(None, 8), host: int = 0) -> PageAllocator:
    return PageAllocator(pages, PS, enable_prefix_caching=True, num_host_pages=host, windows=windows)


def _decode(alloc: PageAllocator, seq: str, tokens: list[int], start: int = 0, ns: str = "m") -> None:
    """Runs `tokens` through seq one position at a time as the scheduler does: commit what is
    computed, release what the window left, grow by one."""
    for pos in range(start, len(tokens)):
        alloc.commit(seq, tokens[alloc.num_committed_pages(seq) * PS:pos], alloc.num_committed_pages(seq) * PS)
        alloc.release_window(seq, pos)
        alloc.grow(seq, pos + 1, pos)
        alloc.check_invariants()


def test_sliding_group_releases_pages_behind_its_window():
    alloc = _alloc()
    alloc.open_groups("a", "m", [[], []], [])
    tokens = list(range(100, 140))
    _decode(alloc, "a", tokens)
    full, sliding = alloc.page_tables("a")
    assert len(full) == len(sliding) == 10
    held = alloc.held_pages("a")
    # the full group holds all 10 pages; the sliding one those from position 39 - 8 + 1 = 32 on
    assert len(held) == 10 + 2 and sliding[8:] == held[10:]
    assert alloc.num_free_pages == 64 - 12
    alloc.free("a")
    alloc.check_invariants()
    assert alloc.num_free_pages == 64


def test_prefix_hit_needs_only_the_window_pages_of_a_sliding_group():
    alloc = _alloc()
    tokens = list(range(200, 241))  # 41 tokens: 10 full pages before the last token
    alloc.open_groups("a", "m", [[], []], [])
    _decode(alloc, "a", tokens)
    alloc.commit("a", tokens, 0)
    alloc.free("a")
    keys = alloc.prefix_keys(tokens, "m")
    cached, n = alloc.match_groups(keys)
    assert n == 40
    # a query at 40 reads keys from 33 on: pages 8 and 9 of the sliding group
    assert all(p is not None for p in cached[0]) and cached[1][:8] == [None] * 8
    assert all(p is not None for p in cached[1][8:])
    alloc.open_groups("b", "m", cached, keys, num_query_tokens=len(tokens))
    alloc.check_invariants()
    assert len(alloc.held_pages("b")) == 12 and alloc.stats.hits == 40
    alloc.release_window("b", 40)
    alloc.grow("b", 41, 40)
    alloc.check_invariants()


def test_a_missing_window_page_shortens_the_match():
    alloc = _alloc(pages=64)
    tokens = list(range(300, 341))
    alloc.open_groups("a", "m", [[], []], [])
    _decode(alloc, "a", tokens)
    alloc.commit("a", tokens, 0)
    sliding_last = alloc.page_tables("a")[1][9]
    alloc.free("a")
    # evict the sliding group's page 9 only: forget its key as an eviction would
    alloc._unkey(sliding_last)
    del alloc._evictable[sliding_last]
    alloc._free.append(sliding_last)
    alloc.check_invariants()
    cached, n = alloc.match_groups(alloc.prefix_keys(tokens, "m"))
    # 40 tokens need sliding page 9; 36 need pages 7 and 8 (positions 29..35), both still cached
    assert n == 36 and cached[1][:7] == [None] * 7 and None not in cached[1][7:]


def test_forks_share_both_groups_and_copy_on_write_per_group():
    alloc = _alloc()
    tokens = list(range(400, 414))  # 14 tokens: the last page is partial
    alloc.open_groups("p", "m", [[], []], [])
    _decode(alloc, "p", tokens)
    alloc.fork("p", "c")
    alloc.check_invariants()
    alloc.release_window("c", 14)
    copies = alloc.grow("c", 15, 14)
    # the partial last page (index 3) is copied in each group
    assert len(copies) == 2 and {src for src, _ in copies} == {alloc.page_tables("p")[0][3], alloc.page_tables("p")[1][3]}
    alloc.check_invariants()


def test_host_tier_keeps_each_groups_pages():
    alloc = _alloc(pages=16, host=32)
    tokens = list(range(500, 521))  # 21 tokens: 5 full pages before the last
    alloc.open_groups("a", "m", [[], []], [])
    _decode(alloc, "a", tokens)
    alloc.commit("a", tokens, 0)
    alloc.free("a")
    alloc.open_groups("filler", "x", [[], []], [])
    alloc.grow("filler", 8 * PS, 0)  # 16 fresh pages: every cached page is evicted to the host
    alloc.drain_transfers()
    alloc.free("filler")
    alloc.check_invariants()
    keys = alloc.prefix_keys(tokens, "m")
    cached, n = alloc.match_groups(keys)
    assert n == 20 and all(p < 0 for p in cached[0])  # the full group's 5 pages, from the host
    assert cached[1][:3] == [None] * 3 and all(p < 0 for p in cached[1][3:])
    alloc.open_groups("b", "m", cached, keys)
    moves = alloc.drain_transfers()
    assert len(moves.promotions) == 7
    alloc.check_invariants()


def test_shipped_pages_carry_every_groups_window():
    src, dst = _alloc(), _alloc()
    tokens = list(range(600, 633))  # 33 tokens: 8 full pages (the last token's included)
    src.open_groups("a", "m", [[], []], [])
    _decode(src, "a", tokens)
    src.commit("a", tokens, 0)
    src.free("a")
    rows = src.device_prefix(tokens, "m")
    # 8 full-group pages, and the sliding group's from position 32 - 8 + 1 = 25 (page 6) on
    assert len(rows) == src.export_rows(8) == 8 + 2
    assert dst.prefix_of_rows(len(rows)) == 8
    pairs = dst.import_pages(tokens, "m", 8)
    assert [row for row, _ in pairs] == list(range(10))
    dst.check_invariants()
    cached, n = dst.match_groups(dst.prefix_keys(tokens + [1], "m"))
    assert n == 32 and cached[0] == [p for r, p in pairs[:8]] and cached[1][6:] == [p for _, p in pairs[8:]]
    with pytest.raises(ValueError, match="no whole prefix"):
        dst.prefix_of_rows(3)  # 1 page ships 2 rows, 2 pages 4


def test_a_proposer_reading_the_first_groups_tables_keeps_its_pages():
    """A draft model or an EAGLE-3 head attends over the target's first group's pages with full
    attention: that group keeps every page when it slides (Phi-3, Mistral with a window)."""
    from jaxserve.core.config import EngineConfig
    from jaxserve.core.kv_groups import kept_windows

    eagle = EngineConfig(speculative_config={"method": "eagle3", "model": "/nowhere", "num_speculative_tokens": 2})
    ngram = EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    for windows in [(8, 8), (8, None)]:
        groups = kv_groups(windows).windows
        assert kept_windows(groups, ngram.speculative_config) == kept_windows(groups) == groups
    assert kept_windows((8,), eagle.speculative_config) == (None,)
    assert kept_windows((None, 8), eagle.speculative_config) == (None, 8)


@pytest.mark.parametrize("name, ratio", [("gemma-3-27b", 3.2), ("gpt-oss-20b", 1.9), ("gemma-2-27b", 1.25)])
def test_the_same_bytes_hold_more_sequences_of_real_stacks(name, ratio):
    """Sequences of 8192 tokens that 64 GiB of bf16 pages hold, pages of 16, steps of 8192 tokens:
    with each layer group's window against every layer keeping every page (single_kv_group):
    measured 54.7 against 16.5 (Gemma 3), 334.5 against 170.7 (gpt-oss-20b), 29.0 against 22.3 (Gemma 2)."""
    import dataclasses
    from pathlib import Path

    from jaxserve.core.capacity import kv_bytes_per_token
    from jaxserve.core.config import ModelConfig

    cfg = ModelConfig.from_hf(Path(__file__).parents[1] / "scripts" / "model_configs" / f"{name}.json")
    held = []
    for c in (cfg, dataclasses.replace(cfg, single_kv_group=True)):
        pages = 64 * 2 ** 30 // (kv_bytes_per_token(c, 2) * 16)
        held.append(c.kv_groups.sequences_held(pages, 8192, 16, 8192))
    assert held[0] > ratio * held[1]


def test_a_tpu_pool_is_lane_dense_and_capacity_counts_its_bytes():
    """On a TPU 64-wide heads (gpt-oss) keep K and V side by side in one 128-lane array, and other
    heads narrower than whole tiles are zero-padded (tests/model/test_family_targets.py shows why):
    gpt-oss's page holds as many tokens as on a GPU, an 80-wide head's takes 128 lanes."""
    from pathlib import Path

    from jaxserve.core.capacity import kv_bytes_per_token
    from jaxserve.core.config import ModelConfig
    from jaxserve.core.kv_groups import fused_kv, pool_head_dim

    widths = (64, 80, 128, 192, 256)
    assert [fused_kv(d, "tpu") for d in widths] == [True, False, False, True, False]
    assert [pool_head_dim(d, "tpu") for d in widths] == [64, 128, 128, 192, 256]
    assert not any(fused_kv(d, p) for d in widths for p in ("cpu", "gpu"))
    assert [pool_head_dim(d, p) for d in (64, 80) for p in ("cpu", "gpu")] == [64, 64, 80, 80]
    # a latent row is one array, never fused: DeepSeek's 576 lanes (which fused_kv's rule would take)
    # padded to whole tiles on a TPU only
    assert fused_kv(576, "tpu") and pool_head_dim(576, "tpu", latent=True) == 640
    assert pool_head_dim(576, "gpu", latent=True) == 576
    cfg = ModelConfig.from_hf(Path(__file__).parents[1] / "scripts" / "model_configs" / "gpt-oss-20b.json")
    gpu = kv_bytes_per_token(cfg, 2, 1, "auto", "gpu")
    assert gpu == 2 * 12 * 8 * 64 * 2  # K and V of 12 pool arrays (2 groups of 12 layers), 8 heads of 64, bf16
    assert kv_bytes_per_token(cfg, 2, 1, "auto", "tpu") == gpu
    narrow = ModelConfig.from_hf({
        "architectures": ["Qwen3ForCausalLM"], "vocab_size": 64, "hidden_size": 320, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 80,
        "max_position_embeddings": 64})
    assert kv_bytes_per_token(narrow, 2, 1, "auto", "tpu") == 2 * 2 * 2 * 128 * 2  # 80 lanes padded to 128
