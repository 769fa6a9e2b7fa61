"""Hybrid linear attention (issue 44) against transformers' PyTorch models: Qwen3-Next (fused
projections, a gated shared expert beside sparse experts), Qwen3.5 (dense) and Qwen3.5-MoE, whose
Gated DeltaNet layers carry a recurrent state per sequence between gated full-attention layers.
Full-sequence logits (left-padded too), each feature shown to matter, greedy generation through the
engine with chunked prefill, mixed decode / prefill steps, preemption (the state recomputed from
zero), n > 1 samples (a fork copies the state slot), a model axis, and the refusals by name."""

from __future__ import annotations

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest

from checkpoints import load_model
from engine_utils import greedy, make_core, run_all
from hf_models import HYBRID_VARIANTS, make_hf_model
from jaxserve.core.config import EngineConfig, ModelConfig
from jaxserve.core.request import Request
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.model.dense import forward_dense
from jaxserve.parallel.sharding import make_mesh

from test_families import IDS, PROMPTS, _logits
from test_parity import _hf_generate, _hf_logits, assert_logits_close


@pytest.fixture(scope="module", params=sorted(HYBRID_VARIANTS))
def variant(request, tmp_path_factory):
    path, model = make_hf_model(request.param, tmp_path_factory.mktemp(request.param))
    return request.param, path, model


def test_config_reads_the_hybrid_stack(variant):
    name, path, _ = variant
    cfg = ModelConfig.from_hf(path)
    assert [k.linear for k in cfg.layers] == [True, False, True, False]
    assert cfg.linear_layers == (0, 2) and cfg.attn_output_gate and cfg.norm_style == "gemma"
    lin = cfg.linear
    assert (lin.num_k_heads, lin.num_v_heads, lin.k_head_dim, lin.v_head_dim, lin.conv_kernel) == (2, 4, 16, 8, 4)
    assert lin.conv_dim == 2 * 2 * 16 + 4 * 8
    assert lin.projections == ("qkvz" if name == "qwen3_next" else "separate")
    # the KV pool holds the two attention layers only
    assert cfg.kv_groups.layer_array == (-1, 0, -1, 1) and cfg.kv_groups.num_arrays == 2
    assert cfg.rope.rotary_dim(cfg.head_dim) == 4  # a quarter of each 16-dim head
    if name == "qwen3_5":
        assert cfg.moe is None
    else:
        assert cfg.moe.shared_gate and cfg.moe.shared_size == 48 and cfg.moe.renormalize
        assert cfg.moe.layers == ((True, False, True, True) if name == "qwen3_next" else (True,) * 4)


def test_full_sequence_logits_match_transformers(variant):
    _, path, model = variant
    cfg, weights = load_model(path, make_mesh(1, 1))
    assert_logits_close(_logits(weights, cfg), _hf_logits(model, IDS, np.ones_like(IDS)))


def test_left_padded_rows_start_their_state_at_their_first_token(variant):
    """A row padded on the left: the padding does not leak into its conv window or delta state."""
    _, path, model = variant
    cfg, weights = load_model(path, make_mesh(1, 1))
    mask = np.ones_like(IDS)
    mask[1, :9] = 0
    ours = np.asarray(forward_dense(weights, cfg, jnp.asarray(IDS), jnp.asarray(mask)))
    ref = _hf_logits(model, IDS, mask)
    assert_logits_close(ours[mask.astype(bool)], ref[mask.astype(bool)])


def test_each_hybrid_feature_changes_the_logits(tmp_path):
    """The parity above would be vacuous if these did not matter: the attention's output gate, the
    conv, the decay (A_log), the gated norm's gate, and the shared expert's gate."""
    path, _ = make_hf_model("qwen3_next", tmp_path / "next")
    cfg, weights = load_model(path, make_mesh(1, 1))
    full = _logits(weights, cfg)

    def changed(**leaves) -> float:
        layers = [lw.replace(**{k: (f(getattr(lw, k)) if getattr(lw, k) is not None else None) for k, f in leaves.items()})
                  for lw in weights.layers]
        return float(np.abs(_logits(weights.replace(layers=layers), cfg) - full).max())

    assert changed(wq_gate=lambda w: w * 0) > 1e-3                        # sigmoid(0) = 1/2 on every head
    assert changed(lin_conv=lambda w: w.at[:, :-1].set(0)) > 1e-3         # no taps on earlier tokens
    assert changed(lin_a_log=lambda w: w - 3.0) > 1e-3                    # slower decay
    assert changed(lin_z=lambda w: w * 0) > 1e-3                          # silu(0) = 0 gates everything off
    assert changed(shared_gate=lambda w: w * 0) > 1e-3                    # the shared expert at half weight


def test_engine_greedy_with_chunks_mixed_steps_and_preemption_equals_generate(variant):
    """Three prompts (one of 42 tokens: prefilled in chunks of the 32-token budget, beside the
    others' decodes) through a pool of 20 pages of 4 tokens that must preempt: a preempted sequence
    recomputes from position 0, so its state restarts from zero in whatever slot it gets."""
    _, path, model = variant
    cfg, weights = load_model(path, make_mesh(1, 1))
    core = make_core(cfg, weights, num_kv_pages=20, max_model_len=64)
    got = run_all(core, [Request(f"r{i}", p, greedy(12)) for i, p in enumerate(PROMPTS)])
    assert [got[f"r{i}"][0] for i in range(len(PROMPTS))] == [_hf_generate(model, [p], 12)[0] for p in PROMPTS]
    assert core.stats().num_preemptions > 0
    assert core.runner.compilations_after_warmup == 0
    states = core.allocator.states
    assert states.num_free == states.num_slots and not states.slot_of  # every slot came back


def test_n_samples_fork_the_state_slot(tmp_path):
    """n = 3 greedy samples: the leader prefills all but the prompt's last token, each sample then
    takes its own slot filled from the leader's state (a copy before the step) and runs the last
    token itself: every sample is transformers' greedy output."""
    path, model = make_hf_model("qwen3_5", tmp_path / "q35")
    cfg, weights = load_model(path, make_mesh(1, 1))
    core = make_core(cfg, weights, max_model_len=64)
    copies = []
    step = core.runner.forward

    def recording(inputs):
        copies.extend(map(tuple, inputs.state_copies.tolist()))
        return step(inputs)

    core.runner.forward = recording
    got = run_all(core, [Request("n", PROMPTS[1], greedy(12, n=3))])
    assert [got["n"][i] for i in range(3)] == [_hf_generate(model, [PROMPTS[1]], 12)[0]] * 3
    assert len(copies) == 2 and len({src for src, _ in copies}) == 1  # two siblings from the leader's slot
    assert core.runner.compilations_after_warmup == 0


def test_prefix_caching_with_state_snapshots_equals_no_caching(tmp_path):
    """The test that matters: prompts sharing a prefix at many lengths (page multiples and not), in
    waves so later ones hit what earlier ones cached, through an engine with prefix caching and one
    without: token for token the same (greedy, and sampled with a seed). A hit restores the state
    snapshotted at the longest cached page boundary and recomputes only the rest."""
    path, _ = make_hf_model("qwen3_next", tmp_path / "next")
    cfg, weights = load_model(path, make_mesh(1, 1))
    rng = np.random.default_rng(7)
    shared = rng.integers(3, 96, 44).tolist()
    cuts = [(5, 3), (8, 1), (13, 6), (16, 4), (21, 2), (24, 9), (31, 1), (36, 5), (40, 3), (44, 0), (44, 6), (9, 0)]
    prompts = [shared[:n] + rng.integers(3, 96, extra).tolist() for n, extra in cuts]
    waves = [prompts[:2], prompts[2:6], prompts[6:9], prompts[9:]]
    cached = make_core(cfg, weights, max_model_len=64)
    plain = make_core(cfg, weights, max_model_len=64, enable_prefix_caching=False)
    assert cached.allocator.states.num_snapshots > 0 and plain.allocator.states.num_snapshots == 0
    for w, wave in enumerate(waves):
        def requests():
            return ([Request(f"g{w}.{i}", p, greedy(8)) for i, p in enumerate(wave)]
                    + [Request(f"s{w}.{i}", p, SamplingParams(temperature=1.0, seed=i, max_tokens=8, ignore_eos=True))
                       for i, p in enumerate(wave)])
        assert run_all(cached, requests()) == run_all(plain, requests()), w
    assert cached.allocator.states.num_restored >= 8  # most prompts started from a snapshot
    assert cached.num_prefill_tokens < 0.6 * plain.num_prefill_tokens
    assert cached.runner.compilations_after_warmup == 0


def test_prefill_chunks_end_on_page_boundaries_and_snapshot_there(tmp_path):
    """With snapshots on, a prefill chunk is cut at the last page boundary inside it (the rest, less
    than a page, runs next step), and each chunk ending on a boundary writes a snapshot slot."""
    path, _ = make_hf_model("qwen3_5", tmp_path / "q35")
    cfg, weights = load_model(path, make_mesh(1, 1))
    core = make_core(cfg, weights, max_model_len=64)
    plans = []
    schedule = core.scheduler.schedule

    def recording():
        plan = schedule()
        plans.append([(c.start_pos, len(c.token_ids), plan.state_snapshots.get(c.seq_id)) for c in plan.listed])
        return plan

    core.scheduler.schedule = recording
    run_all(core, [Request("r", PROMPTS[2], greedy(2))])  # 42 tokens, a 32-token budget, pages of 4
    chunks = [c for plan in plans for c in plan if c[1] > 1]
    assert [(start, n) for start, n, _ in chunks] == [(0, 32), (32, 8), (40, 2)]  # 40: the last boundary
    first, second, tail = (slot for _, _, slot in chunks)
    assert min(first, second) >= core.allocator.states.num_slots and first != second and tail is None


@pytest.mark.parametrize("setting, flag", [
    (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2}), "--speculative-config"),
    (dict(enable_lora=True), "--enable-lora"), (dict(kv_offload_gib=0.01), "--kv-offload-gib"),
    (dict(kv_role="prefill"), "--kv-role")])
def test_features_that_would_lose_the_state_are_refused_by_name(tmp_path, setting, flag):
    from jaxserve.core.linear_limits import check_linear

    cfg = ModelConfig.from_hf(make_hf_model("qwen3_5", tmp_path / "q35")[0])
    with pytest.raises(ValueError, match=f"{flag} is not supported yet for Qwen3_5ForCausalLM"):
        check_linear(EngineConfig(**setting), cfg)


def test_engine_on_a_model_axis_equals_transformers(tmp_path):
    """Attention heads split over a 2-way model axis; the state slots replicated."""
    path, model = make_hf_model("qwen3_next", tmp_path / "next")
    mesh = make_mesh(1, 2)
    cfg, weights = load_model(path, mesh)
    core = make_core(cfg, weights, mesh=mesh, max_model_len=64)
    got = run_all(core, [Request(f"r{i}", p, greedy(8)) for i, p in enumerate(PROMPTS)])
    assert [got[f"r{i}"][0] for i in range(len(PROMPTS))] == [_hf_generate(model, [p], 8)[0] for p in PROMPTS]
    assert core.runner.compilations_after_warmup == 0  # the states keep their placement step to step


def test_the_pool_plan_counts_the_state_slots(tmp_path):
    """Each slot holds, per linear layer, the conv window (3 x 96 float32) and the delta state
    (4 x 16 x 8 float32); a pool sized from memory leaves room for max_num_seqs + 1 of them and, with
    prefix caching, max_num_seqs snapshots."""
    from jaxserve.core.capacity import MachineInfo, linear_state_bytes, plan_capacity

    cfg = ModelConfig.from_hf(make_hf_model("qwen3_5", tmp_path / "q35")[0])
    assert linear_state_bytes(cfg, 4) == 2 * (3 * 96 * 4 + 4 * 16 * 8 * 4)
    engine = EngineConfig(page_size=4, max_num_seqs=7, max_num_batched_tokens=32, max_model_len=64,
                          kv_cache_memory=1 << 20)
    plain = dataclasses.replace(cfg, linear=None, layers=tuple(dataclasses.replace(k, mixer="attention")
                                                               for k in cfg.layers))
    machine = MachineInfo("cpu", "test cpu", memory_per_device=8 << 30, cpu_cores=2)
    with_states = plan_capacity(engine, cfg, machine, 4)
    assert any("recurrent-state slots" in line for line in with_states.lines)
    page = 2 * 2 * 2 * 16 * 4 * 4  # two attention layers' K and V, 2 heads x 16 float32, 4 tokens a page
    assert with_states.engine.num_kv_pages == ((1 << 20) - (8 + 7) * linear_state_bytes(cfg, 4)) // page
    uncached = plan_capacity(dataclasses.replace(engine, enable_prefix_caching=False), cfg, machine, 4)
    assert uncached.engine.num_kv_pages == ((1 << 20) - 8 * linear_state_bytes(cfg, 4)) // page
    assert plan_capacity(engine, plain, machine, 4).engine.num_kv_pages == (1 << 20) // (2 * page)


def test_unsupported_hybrid_fields_are_refused_by_name(tmp_path):
    path, _ = make_hf_model("qwen3_5", tmp_path / "q35")
    config = json.loads((path / "config.json").read_text())
    with pytest.raises(ValueError, match="'layer_types' has unsupported entries"):
        ModelConfig.from_hf({**config, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"})
    with pytest.raises(ValueError, match="linear_num_value_heads"):
        ModelConfig.from_hf({**config, "linear_num_value_heads": 3})


def test_the_multimodal_checkpoint_serves_its_text_model(tmp_path):
    """Qwen3.5 is published as Qwen3_5ForConditionalGeneration: its text_config and the language
    model's tensors are read, the vision encoder's are not."""
    import torch
    import transformers

    text = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                linear_key_head_dim=16, linear_value_head_dim=8, max_position_embeddings=256,
                layer_types=["linear_attention", "full_attention"])
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4)
    torch.manual_seed(0)
    model = transformers.Qwen3_5ForConditionalGeneration(transformers.Qwen3_5Config(text_config=text,
                                                                                    vision_config=vision)).eval()
    model.save_pretrained(tmp_path / "vl")
    cfg, weights = load_model(tmp_path / "vl", make_mesh(1, 1))
    assert cfg.architecture == "Qwen3_5ForConditionalGeneration" and cfg.linear_layers == (0,)
    with torch.no_grad():
        ref = model(input_ids=torch.tensor(IDS, dtype=torch.long)).logits.numpy()
    assert_logits_close(_logits(weights, cfg), ref)


@pytest.mark.parametrize("name, linear, slot_mib", [("qwen3-next-80b-a3b", 36, 73.69), ("qwen3.5-35b-a3b", 30, 61.41)])
def test_published_configs_read_as_hybrids(name, linear, slot_mib):
    """The real configs (scripts/model_configs): three linear layers of every four, each sequence's
    state slot ~60-75 MiB in bf16 (the delta states in float32: 32 heads of 128 x 128)."""
    from pathlib import Path

    from jaxserve.core.capacity import linear_state_bytes

    cfg = ModelConfig.from_hf(Path(__file__).parents[2] / "scripts" / "model_configs" / f"{name}.json")
    assert len(cfg.linear_layers) == linear and cfg.kv_groups.num_arrays == cfg.num_layers - linear
    assert [k.linear for k in cfg.layers[:4]] == [True, True, True, False]
    assert round(linear_state_bytes(cfg, 2) / 2**20, 2) == slot_mib
    assert cfg.moe.shared_gate and cfg.rope.rotary_dim(cfg.head_dim) == 64


def test_state_slots_follow_open_fork_and_free():
    """The allocator's slots: taken at opening, a fork's slot copied from its parent's (drained once),
    returned at freeing; running out names max_num_seqs."""
    from jaxserve.engine.page_allocator import PageAllocator

    alloc = PageAllocator(16, 4, enable_prefix_caching=False, num_state_slots=3)
    alloc.open("a", "ns")
    alloc.fork("a", "b")
    slots = alloc.states.slot_of
    assert slots["a"] != slots["b"] and alloc.states.drain_copies() == [(slots["a"], slots["b"])]
    assert alloc.states.drain_copies() == []
    alloc.open("c", "ns")
    with pytest.raises(RuntimeError, match="max_num_seqs"):
        alloc.open("d", "ns")
    freed = slots["a"]
    alloc.free("a")
    alloc.open("d", "ns")
    assert alloc.states.slot_of["d"] == freed and alloc.states.num_free == 0


def test_a_shared_prefix_is_snapshotted_at_its_end_by_the_second_prompt(tmp_path):
    """Prompts sharing 22 tokens (5 whole pages of 4) then differing: the first snapshots only where
    its own chunks end; the second matches the shared pages without a snapshot at their end, so its
    first chunk ends there and snapshots it; the third restores all 20 tokens. Outputs equal an
    engine without prefix caching."""
    from engine_utils import run_events

    from jaxserve.engine.state_slots import StateSlots

    assert StateSlots.snapshot_length(0, 30, 4, match_end=20) == 20   # cut where the match ended
    assert StateSlots.snapshot_length(0, 30, 4) == 28                  # else at the last boundary
    assert StateSlots.snapshot_length(20, 3, 4) == 3                   # a chunk within one page is kept
    path, _ = make_hf_model("qwen3_5", tmp_path / "q35")
    cfg, weights = load_model(path, make_mesh(1, 1))
    shared = list(range(10, 32))
    prompts = [shared + tail for tail in ([40, 41, 42, 43, 44, 45], [50, 51, 52], [60, 61, 62, 63, 64])]
    cached = make_core(cfg, weights, max_model_len=64)
    plain = make_core(cfg, weights, max_model_len=64, enable_prefix_caching=False)
    hits = []
    for i, p in enumerate(prompts):
        events = run_events(cached, Request(f"p{i}", p, greedy(6)))
        hits.append(events[0].num_cached_prompt_tokens)
        assert [e.token_id for e in events] == run_all(plain, [Request(f"p{i}", p, greedy(6))])[f"p{i}"][0]
    assert hits == [0, 0, 20]


def test_the_deployment_plan_counts_the_state_slots():
    """`jaxserve plan` of Qwen3-Next-80B on 8 H200s: the states (replicated on every device: 256 + 1
    running slots and 256 snapshots of 73.7 MiB) enter the total and the report, and the largest
    pool that fits leaves them room."""
    from pathlib import Path

    from jaxserve.core.capacity import linear_state_bytes
    from jaxserve.parallel.layouts import make_layout
    from jaxserve.planning.plan import plan_deployment
    from jaxserve.planning.report import format_plan
    from jaxserve.planning.targets import parse_target

    cfg = ModelConfig.from_hf(Path(__file__).parents[2] / "scripts" / "model_configs" / "qwen3-next-80b-a3b.json")
    engine = EngineConfig(max_num_seqs=256, max_model_len=32768)
    plan = plan_deployment(cfg, parse_target("gpu-h200:1x1x8"), make_layout("tp", 8, 8), engine, "bfloat16",
                           compile_programs=False)
    assert plan.state_bytes == (257 + 256) * linear_state_bytes(cfg, 2)
    assert plan.total_bytes == (plan.weight_bytes + plan.state_bytes + plan.kv_pool_bytes + plan.temp_bytes
                                + plan.code_bytes)
    assert plan.fits and plan.total_bytes <= plan.usable_bytes
    assert "recurrent-state slots" in format_plan(plan)
