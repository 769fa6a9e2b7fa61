"""The engine under load: continuous batching, preemption, prefix caching, seeds, n > 1, abort."""

from __future__ import annotations

import functools
import random
import time

import pytest

from engine_utils import greedy, make_core, run_all, tiny_model
from jaxserve.core.request import FinishReason, Request
from jaxserve.core.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    cfg, weights, _ = tiny_model(tmp_path_factory.mktemp("m"), "qwen3-qknorm", seed=7)
    return cfg, weights


@pytest.fixture(scope="module", params=[True, False], ids=["async", "sync"])
def make(request, model):
    """make(**engine_overrides) -> a warmed-up EngineCore; every test runs with and without async scheduling."""
    return functools.partial(make_core, *model, async_scheduling=request.param)


def _assert_idle(core):
    alloc = core.allocator
    alloc.check_invariants()
    assert alloc.num_free_pages == alloc.num_pages  # free or evictable (cached)
    assert all(alloc.ref_count(p) == 0 for p in range(alloc.num_pages))


def _random_requests(seed: int, count: int):
    rng = random.Random(seed)
    return [Request(f"q{i}", [rng.randrange(1, 96) for _ in range(rng.randint(1, 40))], greedy(rng.randint(1, 16)))
            for i in range(count)]


def _alone(make, requests):
    core = make()
    out = {}
    for r in requests:
        out.update(run_all(core, [r]))
    _assert_idle(core)
    return out


def test_continuous_batching_with_random_arrivals_equals_run_alone(make):
    requests = _random_requests(0, 14)
    alone = _alone(make, requests)
    core = make()
    rng = random.Random(1)
    pending = list(requests)
    out: dict = {}
    while pending or core.has_work():
        for _ in range(rng.randint(0, 3)):  # random arrivals between steps
            if pending:
                core.add_request(pending.pop(0))
        for e in core.step():
            out.setdefault(e.request_id, {}).setdefault(e.sample_index, []).append(e.token_id)
        core.allocator.check_invariants()
    assert out == alone
    assert core.runner.compilations_after_warmup == 0
    _assert_idle(core)


def test_preemption_under_a_small_pool_keeps_every_output(make):
    requests = _random_requests(2, 10)
    alone = _alone(make, requests)
    # 24 pages of 4 tokens: far less than 10 requests of up to 56 tokens need at once.
    core = make(num_kv_pages=24, max_model_len=64)
    finishes = []
    out = {}
    for r in requests:
        core.add_request(r)
    while core.has_work():
        for e in core.step():
            out.setdefault(e.request_id, {}).setdefault(e.sample_index, []).append(e.token_id)
            if e.finish_reason is not None:
                finishes.append(e.request_id)
        core.allocator.check_invariants()
    assert core.stats().num_preemptions > 0
    assert sorted(finishes) == sorted(r.request_id for r in requests)  # none lost, none twice
    assert out == alone
    _assert_idle(core)


def test_prefix_cache_computes_only_the_suffix(make):
    core = make(num_kv_pages=96, max_model_len=96, max_num_batched_tokens=32)
    prefix = [random.Random(3).randrange(1, 96) for _ in range(64)]
    assert len(run_all(core, [Request("a", prefix + [5, 6, 7], greedy(4))])["a"][0]) == 4
    before = core.num_prefill_tokens
    second = run_all(core, [Request("b", prefix + [9, 9, 1, 2], greedy(4))])
    assert core.num_prefill_tokens - before == 4  # 64 cached tokens (16 full pages) skipped
    fresh = make()
    assert second == run_all(fresh, [Request("b", prefix + [9, 9, 1, 2], greedy(4))])
    # A different salt never shares the other tenant's pages.
    before = core.num_prefill_tokens
    run_all(core, [Request("c", prefix + [9, 9, 1, 2], greedy(4), cache_salt="tenant-2")])
    assert core.num_prefill_tokens - before == 68
    _assert_idle(core)


def test_seeded_request_is_identical_alone_in_a_batch_and_after_preemption(make):
    params = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=12, seed=1234, ignore_eos=True)
    prompt = [3, 14, 15, 92, 65, 35]
    core = make()
    alone = run_all(core, [Request("s", prompt, params)])["s"][0]
    for position in (0, 5, 15):
        others = [Request(f"o{i}", [i + 1, 2, 3], SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True))
                  for i in range(15)]
        batch = others[:position] + [Request("s", prompt, params)] + others[position:]
        assert run_all(core, batch)["s"][0] == alone
    small = make(num_kv_pages=14, max_model_len=48)
    batch = [Request(f"p{i}", [i + 1] * 20, greedy(20)) for i in range(3)] + [Request("s", prompt, params)]
    got = run_all(small, batch)
    assert small.stats().num_preemptions > 0
    assert got["s"][0] == alone


def test_n_samples_share_prompt_pages_and_differ(make):
    core = make()
    prompt = list(range(1, 31))  # 30 tokens: 7 full pages + a partial one
    peak = []

    def watch():
        peak.append(core.allocator.num_pages - core.allocator.num_free_pages)

    out = run_all(core, [Request("n", prompt, SamplingParams(n=4, temperature=1.0, max_tokens=8, seed=5,
                                                            ignore_eos=True))], on_step=watch)
    samples = [tuple(out["n"][i]) for i in range(4)]
    assert len(set(samples)) == 4
    # Unshared, 4 samples of 38 tokens would hold 4 * 10 pages; sharing the 7 full prompt pages
    # leaves 7 + 4 * 3 at most.
    assert max(peak) <= 7 + 4 * 3
    _assert_idle(core)


def test_abort_frees_pages_at_the_next_step(make):
    core = make()
    core.add_request(Request("long", list(range(1, 20)), greedy(60)))
    for _ in range(3):
        core.step()
    core.abort("long")
    events = core.step()
    assert [(e.request_id, e.finish_reason) for e in events] == [("long", FinishReason.ABORT)]
    assert not core.has_work()
    _assert_idle(core)


def test_decode_step_clock_counts_only_decode_steps_by_their_sequence_bucket(make):
    core = make()
    start = time.perf_counter()
    run_all(core, [Request(f"d{i}", list(range(1, 30 + i)), greedy(12)) for i in range(3)])
    wall = time.perf_counter() - start
    decode = core.timings.decode
    buckets = {s for _, s in core.runner.builder.buckets}
    assert decode and set(decode) <= buckets
    # 3 sequences decode 11 tokens each after their prefill step: at least 10 decode-only steps of 3 rows
    # (bucket 4), none of the prefill steps (30+ tokens) counted
    steps = sum(d.steps for d in decode.values())
    assert steps >= 10 and steps < core.timings.steps
    assert 0 < sum(d.seconds for d in decode.values()) < wall
    # every counted step had 3 (or, as requests finish together, fewer) rows, each reading its whole context
    assert all(d.rows <= 3 * d.steps for d in decode.values())
    assert all(d.context_tokens > 30 * d.rows for d in decode.values())
