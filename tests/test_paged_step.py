"""The ragged paged step: same tokens as the unpaged parity path, donation, zero recompiles, isolation."""

from __future__ import annotations

import random

import jax.numpy as jnp
import numpy as np
import pytest

from engine_utils import greedy, make_core, run_all, tiny_model
from jaxserve.core import capacity
from jaxserve.model import kv_cache
from jaxserve.model.dense import greedy_generate
from jaxserve.runner.compile_counter import CompileCounter
from jaxserve.core.request import Request

PROMPTS = [[5, 17, 33, 2, 9, 41, 7], list(range(3, 50)), [14, 90, 31], [60, 3, 3, 88, 12, 19, 4, 70, 21, 11]]


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    cfg, weights, _ = tiny_model(tmp_path_factory.mktemp("q3"), "qwen3-qknorm", seed=3)
    return cfg, weights


@pytest.fixture(scope="module")
def core(qwen3):
    return make_core(*qwen3)


@pytest.mark.parametrize("variant, async_scheduling", [
    ("qwen3-qknorm", True), ("mistral-window", True), ("llama-rope-dynamic", True), ("qwen3-qknorm", False)])
def test_chunked_paged_greedy_equals_unpaged(variant, async_scheduling, tmp_path):
    # max_num_batched_tokens=8 splits the 47-token prompt into 6 chunks; the window (8) and the
    # dynamic-RoPE length (24) are crossed inside the paged cache.
    cfg, weights, _ = tiny_model(tmp_path, variant, seed=5)
    core = make_core(cfg, weights, max_num_batched_tokens=8, token_buckets=(8,), seq_buckets=(4, 8),
                     max_num_seqs=4, max_model_len=64 if variant != "llama-rope-dynamic" else 24 + 40,
                     async_scheduling=async_scheduling)
    prompts = PROMPTS if variant != "llama-rope-dynamic" else [PROMPTS[0]]  # dynamic RoPE: HF is batch-dependent
    out = run_all(core, [Request(f"r{i}", p, greedy(12)) for i, p in enumerate(prompts)])
    expected = greedy_generate(weights, cfg, prompts, 12)
    assert [out[f"r{i}"][0] for i in range(len(prompts))] == expected
    assert core.runner.compilations_after_warmup == 0


def test_200_steps_of_varying_batches_compile_nothing(core):
    rng = random.Random(0)
    before = CompileCounter.count()
    steps = 0
    i = 0
    while steps < 200:
        for _ in range(rng.randint(0, 2)):
            prompt = [rng.randrange(96) for _ in range(rng.randint(1, 40))]
            params = greedy(rng.randint(1, 12))
            if rng.random() < 0.3:  # sampling rows, penalties and logprobs vary the sampler inputs
                params = params.__class__(temperature=0.8, top_k=rng.choice([-1, 5]), top_p=rng.choice([1.0, 0.9]),
                                          presence_penalty=rng.choice([0.0, 0.5]), max_tokens=rng.randint(1, 12),
                                          logprobs=rng.choice([None, 3]), seed=rng.randrange(1000))
            core.add_request(Request(f"v{i}", prompt, params))
            i += 1
        core.step()
        steps += 1
    while core.has_work():
        core.step()
    assert CompileCounter.count() == before
    assert core.runner.compilations_after_warmup == 0


def test_requests_read_only_their_own_pages(qwen3):
    """Poison every page with NaN and hand out pages in shuffled order: outputs stay finite and equal."""
    cfg, weights = qwen3
    prompts = [list(range(1, 45)), [7, 8, 9], list(range(50, 80))]
    requests = lambda tag: [Request(f"{tag}{i}", p, greedy(10, logprobs=0)) for i, p in enumerate(prompts)]  # noqa: E731
    clean = make_core(cfg, weights)
    expected = run_all(clean, requests("c"))

    poisoned = make_core(cfg, weights)
    runner = poisoned.runner
    runner.kv = kv_cache.KVPages(k=[jnp.full_like(a, jnp.nan) for a in runner.kv.k],
                                 v=[jnp.full_like(a, jnp.nan) for a in runner.kv.v])
    order = list(range(runner.num_pages))
    random.Random(1).shuffle(order)
    poisoned.allocator._free.clear()
    poisoned.allocator._free.extend(order)
    logprobs = []
    got = {}
    for r in requests("p"):
        poisoned.add_request(r)
    while poisoned.has_work():
        for e in poisoned.step():
            got.setdefault(e.request_id, []).append(e.token_id)
            logprobs.append(e.logprob)
        tables = [poisoned.allocator.page_table(s) for s in list(poisoned.scheduler._seqs)
                  if poisoned.allocator.has_sequence(s)]
        for t in tables:  # long sequences really span non-contiguous pages
            if len(t) > 3:
                assert any(b != a + 1 for a, b in zip(t, t[1:]))
    assert all(np.isfinite(lp) for lp in logprobs)
    assert [got[f"p{i}"] for i in range(3)] == [expected[f"c{i}"][0] for i in range(3)]


def test_kv_pages_are_donated_and_never_copied(qwen3):
    cfg, weights = qwen3
    core = make_core(cfg, weights)
    old_k = core.runner.kv.k[0]
    run_all(core, [Request("d", [1, 2, 3], greedy(2))])
    assert old_k.is_deleted()  # the step consumed the input buffer

    def step_memory(num_pages: int):
        c = make_core(cfg, weights, num_kv_pages=num_pages)
        from jaxserve.core.buckets import Program
        return c.runner.compile(Program("forward", 8, 8)).memory_analysis(), capacity.kv_bytes_per_token(cfg, 4) * 4 * num_pages

    small, small_pool = step_memory(32)
    large, large_pool = step_memory(1024)
    # Outputs alias the donated pool, and scratch memory does not grow with the pool.
    assert large.alias_size_in_bytes >= large_pool
    assert small.alias_size_in_bytes >= small_pool
    assert large.temp_size_in_bytes == small.temp_size_in_bytes


@pytest.mark.parametrize("layout", ["padded", "fused"])
@pytest.mark.parametrize("variant", ["qwen3-qknorm", "mistral-window"])
def test_a_tpu_pool_layout_serves_the_same_tokens(variant, layout, monkeypatch, tmp_path):
    """A TPU pool stores narrow heads zero-padded to whole 128-lane tiles (kv_groups.pool_head_dim) or,
    when K and V together fill them, side by side in one array (kv_groups.fused_kv). Either layout
    on the CPU gives the plain pool's greedy tokens through chunked prefill and decode: the zero
    lanes and the V lanes change no score (kv_cache.write lays K/V out, paged_attend pads q and
    reads the output's own lanes)."""
    cfg, weights, _ = tiny_model(tmp_path, variant, seed=5)
    if layout == "padded":
        monkeypatch.setattr(kv_cache, "pool_head_dim", lambda head_dim, platform, latent=False: 128)
    else:
        monkeypatch.setattr(kv_cache, "fused_kv", lambda head_dim, platform: True)
    core = make_core(cfg, weights, max_num_batched_tokens=8, token_buckets=(8,), seq_buckets=(4, 8),
                     max_num_seqs=4, max_model_len=64)
    kv = core.runner.kv
    assert kv.k[0].shape[-1] == (128 if layout == "padded" else 2 * cfg.head_dim) != cfg.head_dim
    assert len(kv.v) == (0 if layout == "fused" else len(kv.k))
    out = run_all(core, [Request(f"r{i}", p, greedy(12)) for i, p in enumerate(PROMPTS)])
    assert [out[f"r{i}"][0] for i in range(len(PROMPTS))] == greedy_generate(weights, cfg, PROMPTS, 12)


def test_fused_8bit_pages_serve_the_plain_8bit_pools_tokens(monkeypatch, tmp_path):
    """int8 pages fused (kv_groups.fused_kv): K and V quantized each with its own per-token scale, as in
    two arrays, so the tokens are the two-array int8 pool's."""
    cfg, weights, _ = tiny_model(tmp_path, "qwen3-qknorm", seed=5)
    sizes = dict(max_num_batched_tokens=8, token_buckets=(8,), seq_buckets=(4, 8), max_num_seqs=4, max_model_len=64,
                 kv_cache_dtype="int8")
    requests = lambda: [Request(f"r{i}", p, greedy(12)) for i, p in enumerate(PROMPTS)]  # noqa: E731
    plain = run_all(make_core(cfg, weights, **sizes), requests())
    monkeypatch.setattr(kv_cache, "fused_kv", lambda head_dim, platform: True)
    core = make_core(cfg, weights, **sizes)
    assert core.runner.kv.v == [] and core.runner.kv.k[0].dtype == jnp.int8
    assert run_all(core, requests()) == plain
