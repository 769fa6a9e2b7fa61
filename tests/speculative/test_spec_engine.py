"""Speculative decoding (n-gram) through the engine on tiny transformers checkpoints: outputs are
token-for-token those of the same engine without speculation, greedy across the parity families and
seeded sampling too (one-hot drafts are verified by sampling each row with its own key: speculative/accept.py),
with logprobs, penalties, min_tokens, n > 1, preemption and prefix caching, and nothing compiles
after warm-up."""

from __future__ import annotations

import numpy as np
import pytest

from engine_utils import greedy, make_core, run_all, tiny_model
from jaxserve.core.request import Request
from jaxserve.core.sampling_params import SamplingParams

SPEC = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}'


def _repetitive(i: int) -> list[int]:
    """Prompts with repeats, so prompt lookup has something to find from the first decode."""
    motif = [5 + i, 17, 33 + i, 8]
    return motif * 3 + [5 + i]


def _greedy_mix(tag: str) -> list[Request]:
    return ([Request(f"{tag}{i}", _repetitive(i), greedy(24 + 3 * i)) for i in range(4)]
            + [Request(f"{tag}plain", [40, 3, 77, 12, 9], greedy(20)),
               Request(f"{tag}long", list(range(3, 60)), greedy(8))])  # a 57-token prefill in 2 chunks


def _pair(model, **engine):
    return make_core(*model, **engine), make_core(*model, speculative_config=SPEC, **engine)


# gemma2: drafts verified through soft-capped, alternately windowed attention
@pytest.mark.parametrize("variant", ["llama3-gqa-tied", "qwen2-bias", "mistral-window", "gemma2"])
def test_greedy_outputs_equal_plain_decoding_across_families(tmp_path, variant):
    cfg, weights, _ = tiny_model(tmp_path, variant, seed=5)
    plain, spec = _pair((cfg, weights))
    expected = run_all(plain, _greedy_mix("g"))
    assert run_all(spec, _greedy_mix("g")) == expected
    stats = spec.scheduler.spec_stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0
    assert spec.runner.compilations_after_warmup == 0
    assert spec.allocator.num_free_pages == spec.allocator.num_pages


@pytest.fixture(scope="module")
def cores(tmp_path_factory):
    cfg, weights, _ = tiny_model(tmp_path_factory.mktemp("spec"), "qwen3-qknorm", seed=11)
    return _pair((cfg, weights))


def _sampled_mix(tag: str) -> list[Request]:
    def sp(i, **kw):
        return SamplingParams(temperature=0.9, seed=100 + i, max_tokens=30, ignore_eos=True, **kw)

    return [Request(f"{tag}topk", _repetitive(0), sp(0, top_k=5, logprobs=3)),
            Request(f"{tag}topp", _repetitive(1), sp(1, top_p=0.8, min_p=0.05)),
            Request(f"{tag}pen", _repetitive(2), sp(2, top_k=8, repetition_penalty=1.3, frequency_penalty=0.4)),
            Request(f"{tag}min", _repetitive(3), SamplingParams(temperature=0.7, seed=7, max_tokens=20, min_tokens=12,
                                                               stop_token_ids=[17, 8], top_k=4),
                    eos_token_ids=frozenset({2})),
            Request(f"{tag}n3", _repetitive(4), sp(4, n=3, top_k=6)),
            Request(f"{tag}greedy-lp", _repetitive(5), greedy(25, logprobs=2))]


def _events(core, requests):
    for r in requests:
        core.add_request(r)
    out = {}
    while core.has_work():
        for e in core.step():
            out.setdefault((e.request_id, e.sample_index), []).append(
                (e.token_id, None if e.logprob is None else round(e.logprob, 4),
                 None if e.top_logprobs is None else [(i, round(lp, 4)) for i, lp in e.top_logprobs],
                 e.finish_reason))
    return out


def test_seeded_sampling_and_logprobs_equal_plain_decoding(cores):
    plain, spec = cores
    before = spec.scheduler.spec_stats.copy()
    expected = _events(plain, _sampled_mix("s"))
    assert _events(spec, _sampled_mix("s")) == expected
    got = spec.scheduler.spec_stats.since(before)
    assert got.num_accepted_tokens > 0 and got.num_accepted_tokens < got.num_draft_tokens
    assert spec.runner.compilations_after_warmup == 0


def test_preemption_and_prefix_hits_on_pages_written_next_to_rejected_drafts(cores):
    """Enough sequences that the 96-page pool preempts; then prompts that extend earlier outputs hit
    the prefix cache on pages whose tail once held rejected drafts' K/V."""
    plain, spec = cores
    batch = [Request(f"p{i}", _repetitive(i % 6) + [i], greedy(44)) for i in range(8)]
    expected = run_all(plain, batch)
    pre = spec.stats().num_preemptions
    got = run_all(spec, [Request(r.request_id, r.prompt_token_ids, r.params) for r in batch])
    assert got == expected and spec.stats().num_preemptions > pre
    follow = [Request(f"f{i}", _repetitive(i % 6) + [i] + expected[f"p{i}"][0][:30], greedy(10)) for i in range(3)]
    hits = spec.stats().prefix_cache_hits
    assert run_all(spec, follow) == run_all(plain, [Request(r.request_id, r.prompt_token_ids, r.params)
                                                     for r in follow])
    assert spec.stats().prefix_cache_hits - hits >= 3 * 16  # past the 14-token prompts: output pages
    assert spec.runner.compilations_after_warmup == 0
    spec.allocator.check_invariants()


# ---- draft_model: a second model proposes, greedily, on its own K/V in the same pages ----------

def _draft_spec(path) -> dict:
    return {"method": "draft_model", "model": str(path), "num_speculative_tokens": 3}


def _greedy_only(tag: str) -> list[Request]:
    return [r for r in _greedy_mix(tag) if r.request_id != f"{tag}long"] + [
        Request(f"{tag}long", list(range(3, 60)), greedy(12))]


def test_draft_model_equal_to_the_target_is_always_accepted_and_changes_nothing(tmp_path):
    """The target as its own draft (loaded from its directory, as a user names it): every greedy
    draft is the target's argmax, so all are accepted (except past max_tokens)."""
    from hf_models import make_hf_model

    path, _ = make_hf_model("llama3-gqa-tied", tmp_path, seed=5)
    cfg, weights, _ = tiny_model(tmp_path / "same", "llama3-gqa-tied", seed=5)
    plain = make_core(cfg, weights)
    spec = make_core(cfg, weights, speculative_config=_draft_spec(path))
    expected = run_all(plain, _greedy_only("d"))
    assert run_all(spec, _greedy_only("d")) == expected
    stats = spec.scheduler.spec_stats
    assert stats.num_draft_tokens > 50 and stats.num_accepted_tokens == stats.num_draft_tokens
    assert spec.runner.compilations_after_warmup == 0


@pytest.fixture(scope="module")
def draft_core(tmp_path_factory, cores):
    """The module's qwen3 target with a different random qwen3 as its draft."""
    from engine_utils import SMALL_ENGINE
    from jaxserve.core.config import EngineConfig
    from jaxserve.engine.engine_core import EngineCore
    from jaxserve.parallel.sharding import make_mesh

    target = cores[0]
    draft = tiny_model(tmp_path_factory.mktemp("draft"), "qwen3-untied", seed=3)[:2]
    cfg = EngineConfig(**SMALL_ENGINE, speculative_config=_draft_spec("unused"))
    core = EngineCore(target.model_cfg, target.runner.weights, cfg, make_mesh(1, 1), draft=draft)
    core.runner.warmup()
    return core


def test_a_different_draft_model_is_often_rejected_and_changes_nothing(cores, draft_core):
    plain, _ = cores
    stats = draft_core.scheduler.spec_stats
    before = stats.copy()
    assert _events(draft_core, _sampled_mix("x")) == _events(plain, _sampled_mix("x"))
    batch = [Request(f"q{i}", _repetitive(i % 6) + [i], greedy(44)) for i in range(8)]   # preempts
    pre = draft_core.stats().num_preemptions
    assert run_all(draft_core, batch) == run_all(plain, [Request(r.request_id, r.prompt_token_ids, r.params)
                                                         for r in batch])
    assert draft_core.stats().num_preemptions > pre
    got = stats.since(before)
    assert 0 < got.num_accepted_tokens < 0.8 * got.num_draft_tokens
    assert draft_core.runner.compilations_after_warmup == 0
    draft_core.allocator.check_invariants()


def test_a_draft_model_with_another_vocabulary_is_refused(tmp_path, cores):
    from engine_utils import SMALL_ENGINE
    from jaxserve.core.config import EngineConfig
    from jaxserve.engine.engine_core import EngineCore
    from jaxserve.parallel.sharding import make_mesh

    target = cores[0]
    other = tiny_model(tmp_path, "qwen3-qknorm", seed=1, vocab_size=128)[:2]
    cfg = EngineConfig(**SMALL_ENGINE, speculative_config=_draft_spec("unused"))
    with pytest.raises(ValueError, match="vocab_size 128, the target 96"):
        EngineCore(target.model_cfg, target.runner.weights, cfg, make_mesh(1, 1), draft=other)


def test_first_two_tokens_joint_distribution_matches_plain_sampling(cores):
    """Distribution, not identity: independent seeds for the two engines, top_k=5. The second token
    comes from verification (one n-gram draft proposed after the first) whenever the first recurs
    in the prompt; the (first, second) frequencies of the two runs agree (chi-square, p > 1e-3)."""
    from scipy.stats import chi2_contingency

    plain, spec = cores
    prompt = _repetitive(0)
    n = 600

    def pairs(core, seed0):
        reqs = [Request(f"j{seed0}-{i}", prompt, SamplingParams(temperature=1.0, top_k=5, seed=seed0 + i,
                                                                max_tokens=3, ignore_eos=True)) for i in range(n)]
        out = run_all(core, reqs)
        return [tuple(out[r.request_id][0][:2]) for r in reqs]

    before = spec.scheduler.spec_stats.copy()
    a, b = pairs(plain, 10_000), pairs(spec, 50_000)
    drafted = spec.scheduler.spec_stats.since(before)
    assert drafted.num_drafts > n // 4 and 0 < drafted.num_accepted_tokens < drafted.num_drafts
    cats = sorted(set(a) | set(b))
    table = np.array([[a.count(c) for c in cats], [b.count(c) for c in cats]])
    common = table.sum(axis=0) >= 10                   # pool rare pairs so expected counts stay >= 5
    rare = table[:, ~common].sum(axis=1, keepdims=True)
    table = np.hstack([table[:, common]] + ([rare] if rare.sum() else []))
    assert chi2_contingency(table).pvalue > 1e-3
