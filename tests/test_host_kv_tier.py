"""The host KV tier (--kv-offload-gib): evicted prefix-cache pages demoted to host memory and
promoted back on a hit, and preempted sequences swapped out and back in, with outputs identical to
an engine without the tier (which recomputes) and to each request run alone."""

from __future__ import annotations

import pytest

from engine_utils import greedy, make_core, run_all, tiny_model
from jaxserve.engine.page_allocator import PageAllocator, host_page
from jaxserve.core.request import Request

NS = "m\x00"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    cfg, weights, _ = tiny_model(tmp_path_factory.mktemp("tier"))
    return cfg, weights


# ---------------------------------------------------------------- the allocator's two tiers

def _fill(alloc: PageAllocator, seq: str, tokens: list[int]) -> None:
    alloc.open(seq, NS)
    alloc.grow(seq, len(tokens), 0)
    alloc.commit(seq, tokens)
    alloc.free(seq)


def test_an_evicted_cached_page_is_demoted_and_a_hit_promotes_it_back():
    alloc = PageAllocator(4, 2, num_host_pages=3)
    a = [1, 2, 3, 4, 5, 6, 7, 8]
    _fill(alloc, "a", a)  # 4 cached pages, all evictable, a's tail oldest in the LRU
    assert alloc.drain_transfers().demotions == []
    _fill(alloc, "b", [9, 9, 9, 9])  # takes a's two tail pages: demoted to host slots 0 and 1
    assert alloc.drain_transfers().demotions == [(3, 0), (2, 1)] and alloc.num_host_pages_used == 2
    pages, n = alloc.match_prefix(a + [0], NS)
    assert n == 8 and pages == [0, 1, host_page(1), host_page(0)]
    assert alloc.can_allocate(0, holding=pages) and not alloc.can_allocate(1, holding=pages)
    alloc.open("c", NS, pages, num_query_tokens=9)
    moves = alloc.drain_transfers()
    # two device pages for the promotions: b's, demoted first (b's second page gives way to its first
    # in the last free host slot: the other two are being read)
    assert moves.demotions == [(2, 2), (3, 2)] and moves.promotions == [(1, 2), (0, 3)]
    assert alloc.page_table("c") == [0, 1, 2, 3] and alloc.host_hit_tokens == 4
    assert alloc.match_prefix([9, 9, 9, 9, 0], NS) == ([host_page(2)], 2)
    alloc.check_invariants()


def test_a_host_page_promoted_in_a_step_is_not_reused_before_the_next_drain():
    alloc = PageAllocator(2, 1, num_host_pages=1)
    _fill(alloc, "a", [1, 2])
    _fill(alloc, "b", [3])  # a's second page -> the only host slot
    alloc.drain_transfers()
    pages, _ = alloc.match_prefix([1, 2, 0], NS)
    assert pages == [0, host_page(0)]
    alloc.open("c", NS, pages)  # the promotion's device page evicts b's page, whose demotion finds
    moves = alloc.drain_transfers()  # no host slot (the only one is being read): b's page is dropped
    assert moves.promotions == [(0, 1)] and moves.demotions == []
    alloc.check_invariants()
    assert alloc.match_prefix([3, 0], NS) == ([], 0)


def test_forget_drops_the_keys_a_recompute_will_not_use():
    alloc = PageAllocator(4, 2, num_host_pages=4)
    alloc.open("a", NS)
    alloc.grow("a", 4, 0)
    alloc.commit("a", [1, 2, 3, 4])
    alloc.forget("a")
    assert alloc.match_prefix([1, 2, 3, 4, 5], NS) == ([], 0)
    alloc.check_invariants()


# ---------------------------------------------------------------- the engine

def _prompts() -> list[list[int]]:
    """A prefix, four others that push it out of a 24-page pool, then the prefix again."""
    p1 = [(i * 7) % 90 + 3 for i in range(40)]
    others = [[(i * 13 + k * 5) % 90 + 3 for i in range(40)] for k in range(4)]
    return [p1 + [5]] + [o + [6] for o in others] + [p1 + [8, 9]]


def _one_at_a_time(core) -> list[list[int]]:
    return [run_all(core, [Request(f"r{i}", p, greedy(6))])[f"r{i}"][0] for i, p in enumerate(_prompts())]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])  # int8: the scales move with the values
def test_prefix_pages_pushed_out_of_the_device_come_back_from_the_host(model, kv_cache_dtype):
    want = _one_at_a_time(make_core(*model, num_kv_pages=24, kv_cache_dtype=kv_cache_dtype))
    core = make_core(*model, num_kv_pages=24, kv_cache_dtype=kv_cache_dtype, kv_offload_gib=0.001)
    assert core.runner.num_host_pages > 24
    assert _one_at_a_time(core) == want
    stats = core.stats()
    assert stats.host_hit_tokens == 40 and stats.num_promotions == 10 and stats.num_demotions >= 10
    assert core.runner.compilations_after_warmup == 0
    core.allocator.check_invariants()


def test_preempted_sequences_swap_out_and_back_in_with_the_outputs_of_running_alone(model):
    prompts = [[(i * 11 + k * 3) % 90 + 3 for i in range(20 + k)] for k in range(6)]
    alone = [run_all(make_core(*model), [Request("r", p, greedy(30))])["r"][0] for p in prompts]
    outs = {}
    for gib in (None, 0.001):  # recompute, then swap
        core = make_core(*model, num_kv_pages=24, kv_offload_gib=gib)
        got = run_all(core, [Request(f"r{i}", p, greedy(30)) for i, p in enumerate(prompts)])
        outs[gib] = [got[f"r{i}"][0] for i in range(len(prompts))]
        stats = core.stats()
        assert stats.num_preemptions > 0
        if gib is not None:
            assert stats.num_swap_preemptions > 0 and stats.num_swapped_in_pages > 0
            assert core.runner.compilations_after_warmup == 0
    assert outs[None] == outs[0.001] == alone


def test_a_draft_models_pages_move_with_the_targets(tmp_path):
    """The target as its own draft model: every greedy draft is accepted only if the draft's own
    K/V of the promoted prefix pages came back with the target's."""
    from hf_models import make_hf_model

    path, _ = make_hf_model("llama3-gqa-tied", tmp_path, seed=5)
    cfg, weights, _ = tiny_model(tmp_path / "same", "llama3-gqa-tied", seed=5)
    spec = {"method": "draft_model", "model": str(path), "num_speculative_tokens": 3}
    want = _one_at_a_time(make_core(cfg, weights, num_kv_pages=24))
    core = make_core(cfg, weights, num_kv_pages=24, kv_offload_gib=0.001, speculative_config=spec)
    assert _one_at_a_time(core) == want
    stats = core.scheduler.spec_stats
    assert core.stats().num_promotions == 10
    assert stats.num_draft_tokens > 10 and stats.num_accepted_tokens == stats.num_draft_tokens
    assert core.runner.compilations_after_warmup == 0
    # the same model: its pool holds the target's K/V on every page both wrote, promoted ones included
    import numpy as np

    pages, _ = core.allocator.match_prefix(_prompts()[-1], core.engine_cfg.model_id + "\x00")
    assert len(pages) == 10 and all(p >= 0 for p in pages)
    for target, draft in zip(core.runner.kv.k, core.runner.proposer.kv.k):
        np.testing.assert_allclose(np.asarray(draft)[pages], np.asarray(target)[pages], rtol=1e-5, atol=1e-5)


def test_bad_host_tier_settings_are_named():
    from jaxserve.core.config import EngineConfig

    with pytest.raises(ValueError, match="--kv-offload-gib must be > 0"):
        EngineConfig(kv_offload_gib=0)
    with pytest.raises(ValueError, match="--kv-offload-gib needs prefix caching"):
        EngineConfig(kv_offload_gib=1.0, enable_prefix_caching=False)


def test_host_memory_stays_within_the_tier_when_runs_fragment(model):
    """A run of 8 demoted pages of which 7 were promoted again still holds 8 pages' memory while its
    last row is referenced; demoting 7 more pages would hold 15 on an 8-page tier. The sparse run is
    compacted instead (its live row copied out), and what the slots hold is unchanged."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxserve.model import kv_cache
    from jaxserve.parallel.sharding import Placement, make_mesh, replicated
    from jaxserve.runner.host_tier import HostTier

    cfg, _ = model
    mesh = make_mesh(1, 1)
    kv = kv_cache.allocate(cfg, 32, 4, jnp.float32, Placement(mesh))
    kv = jax.tree.map(lambda a: a + jnp.arange(a.shape[0], dtype=a.dtype).reshape(-1, *[1] * (a.ndim - 1)), kv)
    put = lambda a: jax.device_put(a, replicated(mesh))  # noqa: E731
    tier = HostTier(kv, put, capacity=8)
    tier.demote(kv, np.array([[p, p] for p in range(8)]))        # slots 0-7 <- pages 0-7: one run of 8
    kv = tier.promote(kv, np.array([[s, 31] for s in range(1, 8)]))  # 7 rows leave; slot 0 still holds page 0
    assert tier.held_pages == 8
    tier.demote(kv, np.array([[10 + s, s] for s in range(1, 8)]))  # slots 1-7 <- pages 11-17 (runs 4, 2, 1)
    assert tier.held_pages <= tier.capacity == 8
    kv = tier.promote(kv, np.array([[0, 20], [3, 21]]))            # back into device pages 20 and 21
    first = jax.tree.leaves(kv)[0]
    np.testing.assert_array_equal(np.asarray(first[20]), np.full(first.shape[1:], 0.0))   # page 0's content
    np.testing.assert_array_equal(np.asarray(first[21]), np.full(first.shape[1:], 13.0))  # page 13's
