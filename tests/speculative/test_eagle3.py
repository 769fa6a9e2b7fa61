"""EAGLE-3 heads (`{"method": "eagle3"}`) through the engine, on tiny transformers targets and tiny
heads written in the layout the EAGLE authors publish (tests/eagle3_heads.py):

- every proposal equals a PyTorch recomputation from transformers' own hidden states (the oracle of
  which target states the head reads and of the one-token shift), across prefill chunks, decodes
  and verified runs, with a full and a two-token draft vocabulary (d2t);
- outputs are token-for-token those of plain decoding (greedy across families, seeded sampling with
  logprobs and n > 1), with preemption, prefix caching, tensor parallelism, and nothing compiles
  after warm-up;
- a head that does not fit its target is refused with a message that names the field.
"""

from __future__ import annotations

import collections
import json

import pytest

from eagle3_heads import head_config, reference_drafts, write_head
from engine_utils import SMALL_ENGINE, greedy, make_core, record_proposals, run_all, tiny_model
from jaxserve.core.request import Request
from jaxserve.core.sampling_params import SamplingParams

K = 3


def _spec(path) -> dict:
    return {"method": "eagle3", "model": str(path), "num_speculative_tokens": K}


def _requests(tag: str) -> list[Request]:
    return [Request(f"{tag}rep", [5, 17, 33, 8] * 3 + [5], greedy(20)),
            Request(f"{tag}plain", [40, 3, 77, 12, 9], greedy(16)),
            Request(f"{tag}long", list(range(3, 60)), greedy(10))]  # a 57-token prefill in 2 chunks


def _check_against_reference(hf, tensors, config, requests, outputs, proposals) -> int:
    """Every recorded proposal equals the oracle's drafts after that sequence's tokens."""
    prompts = {r.request_id: r.prompt_token_ids for r in requests}
    for seq_id, start, drafts in proposals:
        rid = seq_id.split("#")[0]
        tokens = prompts[rid] + outputs[rid][0]
        known = tokens[:start + 1]                      # through the decode's last token
        assert drafts == reference_drafts(hf, tensors, config, known, len(drafts)), (seq_id, start)
    return len(proposals)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A 4-layer llama target, plain engine, and its greedy outputs (the heads below key off them)."""
    tmp = tmp_path_factory.mktemp("eagle")
    cfg, weights, hf = tiny_model(tmp / "target", "llama3-gqa-tied", seed=3, num_hidden_layers=4)
    plain = make_core(cfg, weights)
    return tmp, cfg, weights, hf, plain, run_all(plain, _requests("r"))


def test_proposals_equal_the_torch_oracle_and_outputs_equal_plain_decoding(llama):
    tmp, cfg, weights, hf, _, expected = llama
    config = head_config(hf, aux_layers=[0, 1, 3])
    tensors = write_head(tmp / "head", config, seed=1)
    core = make_core(cfg, weights, speculative_config=_spec(tmp / "head"))
    seen = record_proposals(core)
    assert run_all(core, _requests("r")) == expected
    assert _check_against_reference(hf, tensors, config, _requests("r"), expected, seen) >= 10
    assert {s for s, _, _ in seen} == {"rrep#0", "rplain#0", "rlong#0"}
    assert core.scheduler.spec_stats.num_draft_tokens > 0
    assert core.runner.compilations_after_warmup == 0
    assert core.allocator.num_free_pages == core.allocator.num_pages


def _two_token_head(tmp, hf, outputs, name, **config_kw):
    """A head with a two-token draft vocabulary mapped (d2t) onto the target's two most frequent
    greedy outputs: its choice between them depends on everything it computes, and it is often
    right, so verified runs are partly accepted."""
    counts = collections.Counter(t for per in outputs.values() for t in per[0])
    targets = sorted(t for t, _ in counts.most_common(2))
    config = head_config(hf, draft_vocab=2, **{"aux_layers": [0, 1, 3], **config_kw})
    return config, write_head(tmp / name, config, seed=2, targets=targets)


def test_a_draft_vocabulary_head_is_partly_accepted_and_matches_the_oracle(llama):
    tmp, cfg, weights, hf, _, expected = llama
    config, tensors = _two_token_head(tmp, hf, expected, "two", aux_layers=[3, 1, 2], norm_before_residual=True)
    core = make_core(cfg, weights, speculative_config=_spec(tmp / "two"))
    seen = record_proposals(core)
    assert run_all(core, _requests("r")) == expected
    stats = core.scheduler.spec_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert _check_against_reference(hf, tensors, config, _requests("r"), expected, seen) >= 5
    assert core.runner.compilations_after_warmup == 0


def test_seeded_sampling_logprobs_and_n_equal_plain_decoding(llama):
    tmp, cfg, weights, hf, plain, _ = llama

    def mix():
        def sp(i, **kw):
            return SamplingParams(temperature=0.8, seed=40 + i, max_tokens=18, ignore_eos=True, **kw)
        return [Request("topk", [5, 17, 33, 8] * 2, sp(0, top_k=4, logprobs=2)),
                Request("n3", [9, 9, 9, 4], sp(1, n=3, top_p=0.9)),
                Request("pen", [7, 8, 7, 8, 7], sp(2, repetition_penalty=1.2, min_tokens=10))]

    def events(c):
        for r in mix():
            c.add_request(r)
        out = {}
        while c.has_work():
            for e in c.step():
                out.setdefault((e.request_id, e.sample_index), []).append(
                    (e.token_id, None if e.logprob is None else round(e.logprob, 4), e.finish_reason))
        return out

    expected = events(plain)
    _two_token_head(tmp, hf, {k: [[t for t, _, _ in v]] for k, v in expected.items()}, "sampled")
    core = make_core(cfg, weights, speculative_config=_spec(tmp / "sampled"))
    assert events(core) == expected
    assert core.scheduler.spec_stats.num_accepted_tokens > 0
    assert core.runner.compilations_after_warmup == 0


@pytest.mark.parametrize("variant", ["qwen3-qknorm", "mistral-window"])
def test_families_with_preemption_and_prefix_hits(tmp_path, variant):
    """A pool small enough to preempt; follow-up prompts extend earlier outputs (prefix hits on pages
    whose head K/V was written by fills and proposals)."""
    cfg, weights, hf = tiny_model(tmp_path / "t", variant, seed=7, num_hidden_layers=4)
    engine = dict(num_kv_pages=48)
    plain = make_core(cfg, weights, **engine)
    batch = [Request(f"p{i}", [5 + i, 17, 33, 8] * 3 + [i], greedy(40)) for i in range(6)]
    expected = run_all(plain, batch)
    _two_token_head(tmp_path, hf, expected, "head", aux_layers=[1, 2, 3])
    core = make_core(cfg, weights, speculative_config=_spec(tmp_path / "head"), **engine)
    assert run_all(core, batch) == expected
    assert core.stats().num_preemptions > 0
    pair = batch[:2]  # fits the pool: its output pages stay cached for the follow-ups
    outputs = run_all(core, pair)
    assert outputs == {r.request_id: expected[r.request_id] for r in pair}
    follow = [Request(f"f{i}", r.prompt_token_ids + outputs[r.request_id][0][:24], greedy(8)) for i, r in enumerate(pair)]
    hits = core.stats().prefix_cache_hits
    assert run_all(core, follow) == run_all(plain, follow)
    assert core.stats().prefix_cache_hits - hits >= 2 * 32  # 37-token prompts: 13 prompt + 24 output tokens
    assert core.scheduler.spec_stats.num_accepted_tokens > 0
    assert core.runner.compilations_after_warmup == 0
    core.allocator.check_invariants()


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_equals_one_device(llama, tp):
    """TP=2 splits the head's 2 KV heads; TP=4 duplicates them (as the target's)."""
    from checkpoints import load_model
    from jaxserve.parallel.sharding import make_mesh

    tmp, _, _, hf, _, expected = llama
    _two_token_head(tmp, hf, expected, f"tp{tp}")
    mesh = make_mesh(1, tp)
    cfg, weights = load_model(tmp / "target", mesh)
    core = make_core(cfg, weights, mesh=mesh, speculative_config=_spec(tmp / f"tp{tp}"))
    assert run_all(core, _requests("r")) == expected
    assert core.scheduler.spec_stats.num_accepted_tokens > 0
    assert core.runner.compilations_after_warmup == 0


def test_exporter_layout_with_its_own_embeddings_loads_the_same(llama):
    """`model.layers.0.*` names and the head's own embed_tokens (some exporters) read as `midlayer.*`."""
    tmp, cfg, weights, hf, _, expected = llama
    config = head_config(hf, aux_layers=[0, 2, 3], embed=True)
    tensors = write_head(tmp / "exported", config, seed=4, prefix="model.layers.0.")
    core = make_core(cfg, weights, speculative_config=_spec(tmp / "exported"))
    seen = record_proposals(core)
    reqs = _requests("r")[:2]
    assert run_all(core, reqs) == {r.request_id: expected[r.request_id] for r in reqs}
    assert _check_against_reference(hf, tensors, config, reqs, expected, seen) >= 5


def _refused(tmp, cfg, weights, config_edit=None, tensors_edit=None):
    from checkpoints.eagle3 import load_eagle3
    from jaxserve.parallel.sharding import make_mesh

    del weights
    path = tmp / "bad"
    raw = json.loads((tmp / "good" / "config.json").read_text())
    if config_edit:
        config_edit(raw)
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps(raw))
    from safetensors.numpy import load_file, save_file
    tensors = load_file(str(tmp / "good" / "model.safetensors"))
    if tensors_edit:
        tensors_edit(tensors)
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError) as e:
        load_eagle3(path, cfg, make_mesh(1, 1))
    return str(e.value)


def test_a_head_that_does_not_fit_its_target_is_refused_by_name(llama):
    tmp, cfg, weights, hf, _, _ = llama
    write_head(tmp / "good", head_config(hf, aux_layers=[0, 1, 3]))
    # the 4-layer target's default layers (2, 2, 1) are only two distinct ones
    assert "eagle_aux_hidden_state_layer_ids" in _refused(tmp, cfg, weights, lambda c: c.pop("eagle_config"))
    assert "needs 3 distinct layers" in _refused(
        tmp, cfg, weights, lambda c: c.update(eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 9]}))
    assert "vocab_size 100, the target 96" in _refused(tmp, cfg, weights, lambda c: c.update(vocab_size=100))
    assert "architectures ['LlamaForCausalLM']" in _refused(
        tmp, cfg, weights, lambda c: c.update(architectures=["LlamaForCausalLM"]))
    assert "missing tensors: ['midlayer.hidden_norm.weight']" in _refused(
        tmp, cfg, weights, tensors_edit=lambda t: t.pop("midlayer.hidden_norm.weight"))
    assert "'fc.weight' has shape (64, 150)" in _refused(
        tmp, cfg, weights, tensors_edit=lambda t: t.update({"fc.weight": t["fc.weight"][:, :150]}))
    assert "draft_vocab_size 8 < vocab_size 96 but no d2t" in _refused(
        tmp, cfg, weights, lambda c: c.update(draft_vocab_size=8))
    (tmp / "pickled").mkdir()
    (tmp / "pickled" / "config.json").write_text((tmp / "good" / "config.json").read_text())
    (tmp / "pickled" / "pytorch_model.bin").write_bytes(b"\0")
    from checkpoints.eagle3 import read_config
    with pytest.raises(ValueError, match="safetensors only"):
        read_config(tmp / "pickled", cfg)


def test_llm_api_serves_an_eagle3_head_on_the_default_model(tmp_path):
    """The user-facing path: LLM(speculative_config=...) names the head by directory; text in, the
    same greedy text out as without it (the embedded default model: real Qwen tokenizer)."""
    import types

    from jaxserve.default_model import CONFIG
    from jaxserve.entrypoints.llm import LLM

    target = types.SimpleNamespace(config=types.SimpleNamespace(**CONFIG))
    write_head(tmp_path / "head", head_config(target, draft_vocab=2, aux_layers=[0, 1, 3]), targets=[11, 13])
    engine = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128, token_buckets=(32,),
                  seq_buckets=(4,), num_kv_pages=64)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = ["Hello, world", "def f(x):\n    return"]
    expected = [o.outputs[0].text for o in LLM(show_progress=False, **engine).generate(prompts, params)]
    llm = LLM(show_progress=False, speculative_config=_spec(tmp_path / "head"), **engine)
    assert [o.outputs[0].text for o in llm.generate(prompts, params)] == expected
    assert llm.core.scheduler.spec_stats.num_draft_tokens > 0
    assert llm.core.runner.compilations_after_warmup == 0
