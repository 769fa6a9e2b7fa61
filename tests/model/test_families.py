"""The layer kinds of 2026 (issue 42) against transformers' PyTorch models: Gemma 2 and 3, OLMo 2,
SmolLM3, Phi-3, GLM-4.5, MiniMax-M2 and gpt-oss — full-sequence logits, each kind's feature shown to matter, greedy generation
through the engine (prompts past the sliding window and the step's token budget, with preemption
and a prefix-cache hit), and tensor parallelism over fake devices equal to one device."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from checkpoints import load_model
from checkpoints.hf import load_weights
from engine_utils import greedy, make_core, run_all
from hf_models import FAMILY_VARIANTS, make_hf_model
from paged_forward import paged_logits
from jaxserve.core.config import ModelConfig
from jaxserve.core.request import Request
from jaxserve.model import weights as W
from jaxserve.model.dense import forward_dense
from jaxserve.parallel.sharding import make_mesh

from test_parity import _hf_generate, _hf_logits, assert_logits_close

FAMILIES = sorted(FAMILY_VARIANTS)
# past the window (8) and the step's token budget (32): the long prompt is prefilled in chunks
PROMPTS = [[5, 17, 33, 2, 9, 41, 7], [60, 3, 3, 88, 12, 19, 4, 70, 21, 11, 56, 8, 23], list(range(3, 45))]
IDS = np.random.default_rng(1).integers(0, 96, size=(2, 40)).astype(np.int32)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    path, model = make_hf_model(request.param, tmp_path_factory.mktemp(request.param))
    return request.param, path, model


def _logits(weights, cfg: ModelConfig) -> np.ndarray:
    return np.asarray(forward_dense(weights, cfg, jnp.asarray(IDS), jnp.ones_like(jnp.asarray(IDS))))


def test_full_sequence_logits_match_transformers(family):
    _, path, model = family
    cfg, weights = load_model(path, make_mesh(1, 1))
    assert_logits_close(_logits(weights, cfg), _hf_logits(model, IDS, np.ones_like(IDS)))


def _without(name: str, cfg: ModelConfig) -> ModelConfig:
    """The config with the feature of the family `name` removed (its parity would be vacuous if
    the tiny model's logits did not depend on it)."""
    kinds = cfg.layers
    if name == "gemma2":    # the soft-caps
        return dataclasses.replace(cfg, attn_soft_cap=None, final_soft_cap=None)
    if name == "gemma3":    # a RoPE per layer type: every layer on the full layers' one
        return dataclasses.replace(cfg, layers=tuple(dataclasses.replace(k, rope=cfg.rope) for k in kinds))
    if name == "olmo2":     # q/k norms over the whole projection: over each head instead
        return dataclasses.replace(cfg, qk_norm="head")
    if name == "smollm3":   # the NoPE layer: RoPE everywhere
        return dataclasses.replace(cfg, layers=tuple(dataclasses.replace(k, rope=cfg.rope) for k in kinds))
    if name == "phi3":      # partial rotary: every dim rotated
        rope = dataclasses.replace(cfg.rope, partial_rotary_factor=1.0)
        return dataclasses.replace(cfg, layers=tuple(dataclasses.replace(k, rope=rope) for k in kinds))
    if name == "glm4_moe":  # experts chosen in the best 2 of 4 groups: from all of them
        return dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, topk_group=cfg.moe.n_group))
    if name == "minimax_m2":  # experts chosen by score + bias: by score alone
        return dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, score_bias=False))
    if name == "gpt_oss":   # the attention sinks
        return dataclasses.replace(cfg, attention_sinks=False)
    raise AssertionError(name)


def test_each_family_feature_changes_the_logits(family):
    name, path, _ = family
    cfg, weights = load_model(path, make_mesh(1, 1))
    full = _logits(weights, cfg)
    if name == "olmo2":  # per-head norms read [hd] weights: give them the first head's
        weights = weights.replace(layers=[lw.replace(q_norm=lw.q_norm[0], k_norm=lw.k_norm[0]) for lw in weights.layers])
    if name == "minimax_m2":
        weights = weights.replace(layers=[lw.replace(choice_bias=None) for lw in weights.layers])
    if name == "gpt_oss":
        weights = weights.replace(layers=[lw.replace(sinks=None) for lw in weights.layers])
    assert np.abs(_logits(weights, _without(name, cfg)) - full).max() > 1e-3


# family -> each layer's (window, RoPE base or None), as its config.json says
LAYER_KINDS = {"gemma2": [(8, 10000.0), (None, 10000.0), (8, 10000.0)],
               "gemma3": [(8, 10000.0), (None, 1e6), (8, 10000.0)],
               "olmo2": [(None, 10000.0)] * 3, "phi3": [(8, 10000.0)] * 3,
               "smollm3": [(None, 2000000.0), (None, 2000000.0), (None, None)],
               "glm4_moe": [(None, 10000.0)] * 3, "minimax_m2": [(None, 10000.0)] * 3,
               "gpt_oss": [(8, 150000.0), (None, 150000.0), (8, 150000.0)]}


def test_configs_carry_the_layer_kinds(family):
    name, path, _ = family
    cfg = ModelConfig.from_hf(path)
    assert [(k.window, k.rope and k.rope.theta) for k in cfg.layers] == LAYER_KINDS[name]
    if name.startswith("gemma"):
        assert cfg.scale == 24 ** -0.5 and cfg.embed_scale == 8.0 and cfg.norm_style == "gemma"
        assert cfg.norm_placement == "sandwich" and cfg.mlp_act == "gelu_tanh"
    if name == "gemma3":
        assert cfg.rope.rope_type == "linear" and cfg.rope.factor == 8.0 and cfg.qk_norm == "head"
    if name == "phi3":
        assert cfg.rope.rotary_dim(cfg.head_dim) == 4
    if name == "olmo2":
        assert cfg.norm_placement == "post" and cfg.qk_norm == "projection"
    if name == "glm4_moe":
        assert cfg.moe.layers == (False, True, True) and cfg.moe.shared_size == 32 and cfg.qk_norm == "head"
        assert (cfg.moe.scoring, cfg.moe.n_group, cfg.moe.topk_group, cfg.moe.routed_scale) == ("sigmoid", 4, 2, 2.5)
        assert cfg.rope.rotary_dim(cfg.head_dim) == 8 and cfg.qkv_bias and not cfg.o_bias
    if name == "gpt_oss":
        assert cfg.attention_sinks and cfg.qkv_bias and cfg.o_bias and cfg.rope.rope_type == "yarn"
        assert not cfg.rope.truncate and cfg.moe.activation == "clamped_swiglu" and cfg.moe.expert_biases
    if name == "minimax_m2":
        assert cfg.moe.score_bias and cfg.qk_norm == "projection" and cfg.rope.rotary_dim(cfg.head_dim) == 8


def test_engine_greedy_with_preemption_and_a_prefix_hit_equals_generate(family):
    """The three sequences do not fit at once: 20 pages of 4 tokens for the full-attention group
    (26 pages at the end), and 11 per sliding group (what a sequence of 64 tokens may hold: its
    window of 8 and a chunk of 32); Phi-3, sliding on every layer, gets those 11 alone. The engine
    preempts and recomputes; the long prompt sent again then reuses its cached pages."""
    _, path, model = family
    cfg, weights = load_model(path, make_mesh(1, 1))
    groups = cfg.kv_groups
    pages = 20 * (None in groups.windows) + 11 * sum(w is not None for w in groups.windows)
    check_preemption_and_prefix_hit(cfg, weights, model, pages)


def check_preemption_and_prefix_hit(cfg, weights, model, pages: int) -> None:
    """PROMPTS through an engine of `pages` pages of 4 tokens that must preempt, then the long one
    again from the prefix cache: every output transformers' greedy one, no compilation."""
    core = make_core(cfg, weights, num_kv_pages=pages, max_model_len=64)
    got = run_all(core, [Request(f"r{i}", p, greedy(12)) for i, p in enumerate(PROMPTS)])
    expected = [_hf_generate(model, [p], 12)[0] for p in PROMPTS]
    assert [got[f"r{i}"][0] for i in range(len(PROMPTS))] == expected
    assert core.stats().num_preemptions > 0
    before = core.num_prefill_tokens
    again = run_all(core, [Request("again", PROMPTS[2], greedy(12))])
    assert core.num_prefill_tokens - before < len(PROMPTS[2])  # a prefix-cache hit
    assert again["again"][0] == expected[2]
    assert core.runner.compilations_after_warmup == 0


def test_int8_kv_pages_stay_near_float32_pages(family):
    """Teacher-forced over 40 tokens (past the window of 8) through the serving forward with int8
    pages against float32 pages: with sinks, soft-caps, NoPE and partial-rotary layers the scales are
    read the same way. Measured: largest error 0.5-4.4 % of the largest logit (Gemma 3's the most),
    greedy tokens equal at 38-40 of 40 positions, the two that differ both near-ties (gap < 0.004)."""
    _, path, _ = family
    cfg, weights = load_model(path, make_mesh(1, 1))
    ref = np.asarray(paged_logits(weights, cfg, IDS[0].tolist(), "auto")[0])
    got = np.asarray(paged_logits(weights, cfg, IDS[0].tolist(), "int8")[0])
    assert np.abs(got - ref).max() < 0.05 * np.abs(ref).max()
    top2 = np.sort(ref, axis=-1)[:, -2:]
    flipped = got.argmax(-1) != ref.argmax(-1)
    assert flipped.mean() <= 0.1 and (top2[flipped, 1] - top2[flipped, 0] < 0.01).all()


@pytest.mark.parametrize("name", ["gemma2", "phi3", "gpt_oss"])
def test_n_samples_forked_past_the_window_each_equal_generate(name, tmp_path):
    """n = 3 greedy samples of a 13-token prompt (past the window of 8; pages of 4): the forks share
    the prompt's full pages and copy its last, partial one, then decode through sliding layers (with
    soft-caps, a window on every layer, sinks): each sample is transformers' greedy output."""
    path, model = make_hf_model(name, tmp_path / name)
    cfg, weights = load_model(path, make_mesh(1, 1))
    core = make_core(cfg, weights, max_model_len=64)
    prompt = PROMPTS[1]
    got = run_all(core, [Request("n", prompt, greedy(12, n=3))])
    assert [got["n"][i] for i in range(3)] == [_hf_generate(model, [prompt], 12)[0]] * 3
    assert core.runner.compilations_after_warmup == 0


def test_engine_on_four_devices_equals_transformers(family):
    """A 4-way model axis over 2 KV heads: heads duplicated (with OLMo 2's k-norm weights), the
    attention kernel shard-mapped over them."""
    _, path, model = family
    mesh = make_mesh(1, 4)
    cfg, weights = load_model(path, mesh)
    core = make_core(cfg, weights, mesh=mesh)
    assert core.runner.model_cfg.num_kv_heads == 4
    got = run_all(core, [Request(f"r{i}", p, greedy(8)) for i, p in enumerate(PROMPTS)])
    for i, p in enumerate(PROMPTS):
        assert got[f"r{i}"][0] == _hf_generate(model, [p], 8)[0], i


def test_tensor_parallel_logits_equal_one_device(family):
    _, path, _ = family
    cfg = ModelConfig.from_hf(path)
    one = _logits(load_weights(path, cfg, make_mesh(1, 1)), cfg)
    placed = jax.device_put(load_weights(path, cfg, make_mesh(1, 1)), W.shardings(W.abstract(cfg), cfg, make_mesh(1, 2)))
    np.testing.assert_allclose(_logits(placed, cfg), one, rtol=2e-5, atol=2e-5)


def test_glm_checkpoints_multi_token_prediction_layers_are_not_read(tmp_path):
    """GLM-4.5 stores its MTP layer as layer num_hidden_layers: served as the decoder alone. A layer
    past the decoder in any other family is still an unexpected tensor."""
    from safetensors.numpy import save_file

    path, model = make_hf_model("glm4_moe", tmp_path / "glm")
    save_file({"model.layers.3.eh_proj.weight": np.zeros((64, 128), np.float32)}, str(path / "mtp.safetensors"))
    cfg, weights = load_model(path, make_mesh(1, 1))
    assert_logits_close(_logits(weights, cfg), _hf_logits(model, IDS, np.ones_like(IDS)))
    other, _ = make_hf_model("olmo2", tmp_path / "olmo2")
    save_file({"model.layers.3.eh_proj.weight": np.zeros((64, 128), np.float32)}, str(other / "mtp.safetensors"))
    with pytest.raises(ValueError, match="unexpected tensor 'model.layers.3.eh_proj.weight'"):
        load_model(other, make_mesh(1, 1))


def _gemma3_multimodal(directory):
    """A tiny Gemma3ForConditionalGeneration (the gemma3 variant's text model, a one-layer SigLIP
    tower) written by save_pretrained, and the torch model."""
    import torch
    import transformers

    from hf_models import _BASE

    text = {**_BASE, **{k: v for k, v in FAMILY_VARIANTS["gemma3"].items() if k != "family"}}
    vision = transformers.SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=28, patch_size=14)
    config = transformers.Gemma3Config(text_config=transformers.Gemma3TextConfig(**text), vision_config=vision,
                                       mm_tokens_per_image=4, image_token_index=95, boi_token_index=93,
                                       eoi_token_index=94)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
    model.save_pretrained(directory)
    return directory, model


def test_gemma3_multimodal_checkpoints_serve_their_text_model(tmp_path):
    """Gemma 3 4B-27B are published as Gemma3ForConditionalGeneration: config.json's text_config
    and the language model's tensors (stored as language_model.model.*, or model.language_model.*
    as transformers 5 names them in memory) are served; the vision tower is not read. Greedy text
    equals transformers' multimodal model on text-only input."""
    from safetensors.numpy import load_file, save_file

    path, model = _gemma3_multimodal(tmp_path / "published")
    stored = load_file(str(path / "model.safetensors"))
    assert any(k.startswith("vision_tower.") for k in stored) and any(k.startswith("language_model.model.") for k in stored)
    cfg, weights = load_model(path, make_mesh(1, 1))
    assert cfg.architecture == "Gemma3ForConditionalGeneration" and cfg.family == "gemma3"
    assert [(k.window, k.rope.theta) for k in cfg.layers] == LAYER_KINDS["gemma3"] and cfg.vocab_size == 96
    core = make_core(cfg, weights, max_model_len=64)
    got = run_all(core, [Request(f"r{i}", p, greedy(10)) for i, p in enumerate(PROMPTS)])
    assert [got[f"r{i}"][0] for i in range(len(PROMPTS))] == [_hf_generate(model, [p], 10)[0] for p in PROMPTS]

    renamed = tmp_path / "in_memory_names"
    renamed.mkdir()
    for f in ("config.json",):
        (renamed / f).write_bytes((path / f).read_bytes())
    save_file({k.replace("language_model.model.", "model.language_model.", 1): v for k, v in stored.items()},
              str(renamed / "model.safetensors"))
    _, again = load_model(renamed, make_mesh(1, 1))
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(weights)))
