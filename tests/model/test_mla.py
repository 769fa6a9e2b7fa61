"""Multi-head latent attention (issue 43): DeepSeek-V3 against transformers' PyTorch model, whose
attention up-projects the latent per head (the expanded form) while ours absorbs the projections
into the query and the output (model/mla.py): full-sequence logits, each MLA feature shown to
matter, greedy generation through the engine over latent pages (preemption, a prefix-cache hit,
chunked prefill, n > 1 forks), int8 latent pages, and a model axis of 2 and 4 over fake devices."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from checkpoints import load_model
from checkpoints.hf import load_weights
from engine_utils import greedy, make_core, run_all
from hf_models import MLA_VARIANTS, make_hf_model
from paged_forward import paged_logits
from jaxserve.core.config import ModelConfig
from jaxserve.core.request import Request
from jaxserve.model import kv_cache
from jaxserve.parallel.sharding import Placement, make_mesh

from test_families import IDS, PROMPTS, _logits, check_preemption_and_prefix_hit
from test_parity import _hf_generate, _hf_logits, assert_logits_close



@pytest.fixture(scope="module", params=sorted(MLA_VARIANTS))
def variant(request, tmp_path_factory):
    path, model = make_hf_model(request.param, tmp_path_factory.mktemp(request.param))
    return request.param, path, model


def test_config_reads_the_latent_attention(variant):
    name, path, _ = variant
    cfg = ModelConfig.from_hf(path)
    m = cfg.mla
    assert (m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim) == (32, 16, 8, 16)
    assert cfg.num_kv_heads == 1 and cfg.head_dim == 40 and cfg.kv_arrays_per_layer == 1
    assert cfg.moe.layers == (False, True, True) and cfg.moe.shared_size == 32 and cfg.moe.scoring == "sigmoid"
    if name == "deepseek_v3":
        assert m.q_lora_rank == 24 and m.rope_interleave and cfg.moe.n_group == 4 and cfg.moe.topk_group == 2
        # YaRN's mscale_all_dim: (0.1 ln 4 + 1)^2 on the whole q.k, not only the rotated dims
        assert cfg.scale == pytest.approx(24 ** -0.5 * (0.1 * np.log(4.0) + 1) ** 2)
    else:
        assert m.q_lora_rank is None and not m.rope_interleave and cfg.scale == pytest.approx(24 ** -0.5)


def test_full_sequence_logits_match_transformers(variant):
    _, path, model = variant
    cfg, weights = load_model(path, make_mesh(1, 1))
    assert_logits_close(_logits(weights, cfg), _hf_logits(model, IDS, np.ones_like(IDS)))


def test_each_latent_attention_feature_changes_the_logits(tmp_path):
    """The parity above would be vacuous if the tiny model ignored what it checks: the RoPE pairs'
    order, the softmax's mscale, the q LoRA's norm and the latent's norm each move the logits."""
    path, _ = make_hf_model("deepseek_v3", tmp_path / "ds")
    cfg, weights = load_model(path, make_mesh(1, 1))
    full = _logits(weights, cfg)
    halves = dataclasses.replace(cfg.mla, rope_interleave=False)
    not_permuted = load_weights(path, dataclasses.replace(cfg, mla=halves), make_mesh(1, 1))
    changed = {
        "interleave": _logits(not_permuted, cfg),
        "mscale": _logits(weights, dataclasses.replace(cfg, attention_scale=24 ** -0.5)),
        "q_a_norm": _logits(weights.replace(layers=[lw.replace(q_a_norm=jnp.ones_like(lw.q_a_norm))
                                                    for lw in weights.layers]), cfg),
        "kv_a_norm": _logits(weights.replace(layers=[lw.replace(kv_a_norm=2 * lw.kv_a_norm)
                                                     for lw in weights.layers]), cfg),
    }
    for what, logits in changed.items():
        assert np.abs(logits - full).max() > 1e-3, what


def test_the_pool_holds_one_latent_row_per_token_and_layer(variant):
    """[pages, page_size, 1, 32 + 8] per layer and no V arrays: 40 numbers per token and layer for
    4 heads, where per-head K and V of the same attention would be 4 x (24 + 16)."""
    _, path, _ = variant
    cfg = ModelConfig.from_hf(path)
    pool = kv_cache.abstract(cfg, 10, 4, jnp.float32, Placement(make_mesh(1, 1)))
    assert [a.shape for a in pool.k] == [(10, 4, 1, 40)] * 3 and pool.v == []
    quantized = kv_cache.abstract(cfg, 10, 4, jnp.int8, Placement(make_mesh(1, 1)))
    assert [a.shape for a in quantized.k_scales] == [(10, 1, 4)] * 3 and quantized.v_scales == []


def test_engine_greedy_with_preemption_and_a_prefix_hit_equals_generate(variant):
    """20 pages of 4 tokens do not hold the three sequences at once: the engine preempts and
    recomputes; the long prompt sent again reuses its cached latent pages."""
    _, path, model = variant
    cfg, weights = load_model(path, make_mesh(1, 1))
    check_preemption_and_prefix_hit(cfg, weights, model, pages=20)


def test_n_samples_fork_the_latent_pages(tmp_path):
    """n = 3 greedy samples share the prompt's full latent pages and copy its last, partial one."""
    path, model = make_hf_model("deepseek_v3", tmp_path / "ds")
    cfg, weights = load_model(path, make_mesh(1, 1))
    core = make_core(cfg, weights, max_model_len=64)
    got = run_all(core, [Request("n", PROMPTS[1], greedy(10, n=3))])
    assert [got["n"][i] for i in range(3)] == [_hf_generate(model, [PROMPTS[1]], 10)[0]] * 3


def test_int8_latent_pages_stay_near_float32_pages(variant):
    """Teacher-forced over 40 tokens through the serving forward: the latent rows quantized per
    token as they are written, read back as K and as V with the same scales."""
    _, path, _ = variant
    cfg, weights = load_model(path, make_mesh(1, 1))
    ref = np.asarray(paged_logits(weights, cfg, IDS[0].tolist(), "auto")[0])
    got = np.asarray(paged_logits(weights, cfg, IDS[0].tolist(), "int8")[0])
    assert_logits_close(np.asarray(paged_logits(weights, cfg, IDS[0].tolist(), "auto")[0])[None],
                        _logits(weights, cfg)[:1])  # the paged forward is the dense one
    assert np.abs(got - ref).max() < 0.05 * np.abs(ref).max()
    top2 = np.sort(ref, axis=-1)[:, -2:]
    flipped = got.argmax(-1) != ref.argmax(-1)
    assert flipped.mean() <= 0.1 and (top2[flipped, 1] - top2[flipped, 0] < 0.01).all()


@pytest.mark.parametrize("model_axis", [2, 4])
def test_engine_on_a_model_axis_equals_transformers(variant, model_axis):
    """Query heads split over the model axis; the one latent row duplicated to one copy per device
    (each device reads the whole latent beside its heads), the attention shard-mapped over them."""
    _, path, model = variant
    mesh = make_mesh(1, model_axis)
    cfg, weights = load_model(path, mesh)
    core = make_core(cfg, weights, mesh=mesh)
    assert core.runner.model_cfg.num_kv_heads == model_axis
    got = run_all(core, [Request(f"r{i}", p, greedy(8)) for i, p in enumerate(PROMPTS)])
    for i, p in enumerate(PROMPTS):
        assert got[f"r{i}"][0] == _hf_generate(model, [p], 8)[0], i


@pytest.mark.parametrize("field, value", [("topk_method", "greedy"), ("scoring_func", "softmax"),
                                          ("attention_bias", True), ("moe_layer_freq", 2)])
def test_unserved_deepseek_fields_are_refused_by_name(tmp_path, field, value):
    import json

    path, _ = make_hf_model("deepseek_v3", tmp_path / "ds")
    config = json.loads((path / "config.json").read_text())
    config[field] = value
    with pytest.raises(ValueError, match=f"'{field}'"):
        ModelConfig.from_hf(config)


def test_latent_pages_swap_through_the_host_tier(tmp_path):
    """Preempted sequences' int8 latent pages (values and scales) go to host memory and come back:
    the outputs are transformers' greedy ones."""
    path, model = make_hf_model("deepseek_v3", tmp_path / "ds")
    cfg, weights = load_model(path, make_mesh(1, 1))
    int8_alone = [run_all(make_core(cfg, weights, kv_cache_dtype="int8"), [Request("r", p, greedy(12))])["r"][0]
                  for p in PROMPTS]
    core = make_core(cfg, weights, num_kv_pages=20, max_model_len=64, kv_cache_dtype="int8", kv_offload_gib=0.001)
    got = run_all(core, [Request(f"r{i}", p, greedy(12)) for i, p in enumerate(PROMPTS)])
    assert [got[f"r{i}"][0] for i in range(len(PROMPTS))] == int8_alone
    stats = core.stats()
    assert stats.num_swap_preemptions > 0 and stats.num_swapped_in_pages > 0
    assert core.runner.compilations_after_warmup == 0


def test_the_pool_size_counts_one_latent_row_per_token(tmp_path):
    """The capacity plan, the planner and the start-up block read kv_bytes_per_token: for MLA one
    latent row of 40 float32 per layer (3 layers), not K and V; a 2-way model axis duplicates the
    row (each device holds it whole). LoRA is refused by name."""
    from jaxserve.core.capacity import attention_weights_per_layer, kv_bytes_per_token
    from jaxserve.parallel.kv_heads import duplicated_config

    path, _ = make_hf_model("deepseek_v3", tmp_path / "ds")
    cfg, weights = load_model(path, make_mesh(1, 1))
    assert kv_bytes_per_token(cfg, 4) == 3 * 40 * 4
    assert kv_bytes_per_token(duplicated_config(cfg, 2), 4, model_axis=2) == 3 * 40 * 4
    assert kv_bytes_per_token(cfg, 2, kv_cache_dtype="int8") == 3 * (40 + 4)  # values and a float32 scale
    # q LoRA (64 x 24 + 24 x 4 x 24), kv_a (64 x 40), the latent's up-projections (32 x 4 x 32), o (4 x 16 x 64)
    assert attention_weights_per_layer(cfg) == 64 * 24 + 24 * 96 + 64 * 40 + 32 * 4 * 32 + 4 * 16 * 64
    with pytest.raises(ValueError, match="LoRA adapters on a latent-attention model"):
        make_core(cfg, weights, enable_lora=True)


def test_deepseek_v3s_published_config_declares_its_671b_weights_and_70_kib_per_token():
    """scripts/model_configs/deepseek-v3.json (the published config, bf16): the declared weights
    count DeepSeek-V3's 671B parameters (the MTP layer not read), a token's latent pages 61 x 576
    bf16 numbers, and its softmax scale folds YaRN's mscale_all_dim (factor 40) into 192 ** -0.5."""
    import math
    from pathlib import Path

    import jax

    from jaxserve.core.capacity import kv_bytes_per_token
    from jaxserve.model.param_spec import is_spec
    from jaxserve.model.weights import abstract

    cfg = ModelConfig.from_hf(Path(__file__).parents[2] / "scripts" / "model_configs" / "deepseek-v3.json")
    params = sum(math.prod(s.shape) for s in jax.tree.leaves(abstract(cfg), is_leaf=is_spec))
    assert round(params / 1e9, 1) == 671.0
    assert kv_bytes_per_token(cfg, 2) == 61 * 576 * 2 == 70272
    assert cfg.scale == pytest.approx(192 ** -0.5 * (0.1 * math.log(40) + 1) ** 2)
    assert cfg.moe.layers == (False,) * 3 + (True,) * 58 and (cfg.moe.n_group, cfg.moe.topk_group) == (8, 4)
