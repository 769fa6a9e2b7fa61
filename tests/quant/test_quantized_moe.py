"""Quantized mixtures of experts: fp8-block checkpoints as Qwen3-MoE-FP8 / GLM-4.5-FP8 publish them, and the
online schemes (--quantization int8 | int4 | fp8) on MoE families.

Each expert is quantized on its own (a scale tile never spans two experts), the stacked leaf [E, in, out] keeps
its values packed on the device, and the step widens a layer's experts to the compute dtype for the grouped
matmuls (model/moe.py). Oracles: the format's reference dequantisation of the stored tensors, transformers'
model loaded with those dequantized weights, and our own forward over the dequantized leaves.
"""

from __future__ import annotations

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file
from safetensors.torch import save_file

from checkpoints import load_model
from engine_utils import greedy, make_core, run_all
from formats import write_fp8_block
from hf_models import make_hf_model
from jaxserve.model import weights as W
from jaxserve.core.request import Request
from jaxserve.model.dense import forward_dense, greedy_generate
from jaxserve.parallel.layouts import RULE_SETS
from jaxserve.parallel.sharding import make_mesh
from jaxserve.quant import host
from jaxserve.quant.scheme import ONLINE
from test_online import dequantized, logits

PROMPTS = [[5, 17, 33, 2, 9, 41, 7], [60, 3, 3, 88, 12, 19, 4, 70, 21, 11, 56, 8, 23], [14, 90, 31]]
BLOCK = 32  # the tiny models' widths are multiples of 32, not of DeepSeek's 128
# max |logit - f32 logit| / max |f32 logit| on the MoE families (measured: int8 <= 0.092, fp8 <= 0.064, int4 <=
# 0.29): above the dense families' (test_online.BOUND), as a weight's rounding can change which experts a token picks
BOUND = {"int8": 0.15, "fp8": 0.12, "int4": 0.45}


def _float_copy(src, dst, weights: dict[str, np.ndarray]):
    """src's checkpoint with each named projection (prefix -> [out, in]) replaced by a float32 weight."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors"):
            shutil.copy2(f, dst / f.name)
    tensors = load_file(str(next(src.glob("*.safetensors"))))
    tensors.update({f"{prefix}.weight": w.astype(np.float32) for prefix, w in weights.items()})
    save_file({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in tensors.items()}, str(dst / "model.safetensors"))
    return dst


def _expert_as_torch(leaf, e: int) -> np.ndarray:
    """Expert e of a stacked quantized leaf [E, in, out], dequantized on the host, as [out, in]."""
    return host.dequantize(np.asarray(leaf.qvalue[e]), np.asarray(leaf.scale[e])).T


def test_fp8_block_experts_load_to_their_reference_dequantisation_and_match_transformers(tmp_path):
    """GLM-4.5's layout (a dense first layer, then routed experts beside a shared expert, an unquantized
    router) in fp8 blocks: every expert, shared expert and dense projection loads to exactly the stored
    tensors' dequantisation, and the logits equal transformers' model with those weights."""
    path, _ = make_hf_model("glm4_moe", tmp_path / "base")
    expected = write_fp8_block(path, tmp_path / "fp8", block=BLOCK)
    cfg, weights = load_model(tmp_path / "fp8", make_mesh(1, 1))
    assert (cfg.quantization.method, cfg.quantization.qtype) == ("fp8-block", "float8_e4m3fn")
    dense, sparse = weights.layers[0], weights.layers[1]
    assert W.is_quantized(dense.w_gate) and not W.is_quantized(sparse.router)
    assert sparse.we_gate.qvalue.dtype == jnp.float8_e4m3fn
    e, d, f = sparse.we_gate.qvalue.shape
    assert sparse.we_gate.scale.shape == (e, d // BLOCK, f // BLOCK)  # blocks within each expert
    for i in (1, 2):
        layer = weights.layers[i]
        for field, name in (("we_gate", "gate_proj"), ("we_up", "up_proj"), ("we_down", "down_proj")):
            for x in range(e):
                np.testing.assert_array_equal(_expert_as_torch(getattr(layer, field), x),
                                              expected[f"model.layers.{i}.mlp.experts.{x}.{name}"])
        shared = host.dequantize(np.asarray(layer.ws_down.qvalue), np.asarray(layer.ws_down.scale)).T
        np.testing.assert_array_equal(shared, expected[f"model.layers.{i}.mlp.shared_experts.down_proj"])

    ids = np.random.default_rng(3).integers(0, cfg.vocab_size, size=(2, 24)).astype(np.int32)
    ref = _hf_logits(_float_copy(path, tmp_path / "dequantized", expected), ids)
    ours = np.asarray(forward_dense(weights, cfg, jnp.asarray(ids), jnp.ones_like(jnp.asarray(ids))))
    assert np.abs(ours - ref).max() <= 1e-4 * np.abs(ref).max()


@pytest.mark.parametrize("variant", ["qwen3-moe", "mixtral", "glm4_moe"])
def test_online_schemes_quantize_every_expert_on_its_own(variant, tmp_path):
    """--quantization on an MoE checkpoint: each expert's projection is quantized like a Linear of its
    own, the forward equals the one over the dequantized leaves, and stays near float32."""
    path, _ = make_hf_model(variant, tmp_path)
    cfg, weights = load_model(path, make_mesh(1, 1))
    ref = logits(weights, cfg)
    sparse = next(i for i, layer in enumerate(weights.layers) if layer.we_gate is not None)
    for name in ONLINE:
        qcfg, qweights = load_model(path, make_mesh(1, 1), quantization=name)
        leaf, plain = qweights.layers[sparse].we_up, np.asarray(weights.layers[sparse].we_up)  # [E, D, Fe]
        assert W.is_quantized(leaf) and leaf.qvalue.dtype == ONLINE[name].dtype
        for x in range(plain.shape[0]):  # the host rule applied to expert x alone
            values, scale = host.quantize(plain[x], ONLINE[name].dtype, leaf.scale.shape[1:])
            np.testing.assert_array_equal(np.asarray(leaf.qvalue[x]), values)
            np.testing.assert_allclose(np.asarray(leaf.scale[x]), scale, rtol=1e-6)
        ours = logits(qweights, qcfg)
        oracle = logits(dequantized(qweights), cfg)
        np.testing.assert_allclose(ours, oracle, rtol=0, atol=1e-5 * np.abs(oracle).max())
        rel = np.abs(ours - ref).max() / np.abs(ref).max()
        assert 0 < rel <= BOUND[name], f"{name}: max logit error {rel:.4f} of max |logit|"


def _hf_logits(directory, ids) -> np.ndarray:
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager",
                                                           dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(input_ids=torch.tensor(ids, dtype=torch.long)).logits.numpy()


def test_fp8_block_deepseek_v3_loads_its_latent_attention_widened_and_matches_transformers(tmp_path):
    """DeepSeek-V3 as published in fp8 blocks: the projections whose blocks tile our layout stay fp8
    (q_a_proj, its 24 rows one partial block; o_proj; the MLPs and experts), the ones whose blocks
    straddle heads (q_b_proj: 32-row blocks over 24-row heads) or end past the rows
    (kv_a_proj_with_mqa: 40 rows in blocks of 32), and kv_b_proj (split into W_uk / W_uv), are widened
    at load; logits equal transformers' with the dequantized weights."""
    path, _ = make_hf_model("deepseek_v3", tmp_path / "base")
    expected = write_fp8_block(path, tmp_path / "fp8", block=BLOCK)
    cfg, weights = load_model(tmp_path / "fp8", make_mesh(1, 1))
    assert cfg.quantization.method == "fp8-block"
    attn, sparse = weights.layers[0], weights.layers[1]
    for leaf in (attn.wq_a, attn.wo, attn.w_gate, sparse.we_down, sparse.ws_up):
        assert W.is_quantized(leaf)
    for leaf in (attn.wq, attn.wkv_a, attn.w_uk, attn.w_uv):
        assert not W.is_quantized(leaf)
    ids = np.random.default_rng(3).integers(0, cfg.vocab_size, size=(2, 24)).astype(np.int32)
    ref = _hf_logits(_float_copy(path, tmp_path / "dequantized", expected), ids)
    ours = np.asarray(forward_dense(weights, cfg, jnp.asarray(ids), jnp.ones_like(jnp.asarray(ids))))
    assert np.abs(ours - ref).max() <= 1e-4 * np.abs(ref).max()


def test_online_schemes_on_latent_attention_equal_their_dequantized_weights(tmp_path):
    path, _ = make_hf_model("deepseek_v3", tmp_path)
    cfg, weights = load_model(path, make_mesh(1, 1))
    ref = logits(weights, cfg)
    qcfg, qweights = load_model(path, make_mesh(1, 1), quantization="int8")
    layer = qweights.layers[0]
    assert all(W.is_quantized(x) for x in (layer.wq_a, layer.wq, layer.wkv_a, layer.wo))
    assert not W.is_quantized(layer.w_uk) and not W.is_quantized(layer.w_uv)
    ours = logits(qweights, qcfg)
    oracle = logits(dequantized(qweights), cfg)
    np.testing.assert_allclose(ours, oracle, rtol=0, atol=1e-5 * np.abs(oracle).max())
    assert 0 < np.abs(ours - ref).max() / np.abs(ref).max() <= BOUND["int8"]


def test_config_names_the_fp8_expert_scheme(tmp_path):
    path, _ = make_hf_model("qwen3-moe", tmp_path / "base", hidden_size=64, moe_intermediate_size=64)
    write_fp8_block(path, tmp_path / "fp8", block=BLOCK)
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())
    assert config["quantization_config"]["weight_block_size"] == [BLOCK, BLOCK]
    cfg, weights = load_model(tmp_path / "fp8", make_mesh(1, 1))
    assert "32x32 blocks" in cfg.quantization.describe()
    assert all(W.is_quantized(layer.we_down) for layer in weights.layers if layer.we_down is not None)


@pytest.fixture(scope="module")
def fp8_qwen3_moe(tmp_path_factory):
    """Qwen3-MoE in fp8 blocks of 32 (hidden 64, expert width 64: two blocks per expert projection)."""
    path, _ = make_hf_model("qwen3-moe", tmp_path_factory.mktemp("base"), moe_intermediate_size=64)
    dst = tmp_path_factory.mktemp("fp8") / "model"
    write_fp8_block(path, dst, block=BLOCK)
    return dst


@pytest.mark.parametrize("mesh_shape,layout", [((1, 1), "tp"), ((1, 2), "tp"), ((1, 4), "tp-ep"),
                                               ((2, 4), "tp-ep-data")])
def test_engine_serves_fp8_experts_like_the_dense_path_on_every_layout(fp8_qwen3_moe, mesh_shape, layout):
    """The paged step over fp8 experts (widened in the step; expert parallelism widens before its
    all-to-all) gives the dense parity path's greedy tokens, batched, with the experts' width split
    (tp) or whole experts per device (tp-ep, tp-ep-data); nothing compiles after warm-up."""
    mesh = make_mesh(*mesh_shape)
    cfg, weights = load_model(fp8_qwen3_moe, mesh, rules=RULE_SETS[layout])
    one_cfg, one = load_model(fp8_qwen3_moe, make_mesh(1, 1))
    expected = greedy_generate(one, one_cfg, PROMPTS, 10)
    core = make_core(cfg, weights, mesh=mesh, layout=layout)
    got = run_all(core, [Request(f"r{i}", p, greedy(10)) for i, p in enumerate(PROMPTS)])
    assert [got[f"r{i}"][0] for i in range(len(PROMPTS))] == expected
    assert core.runner.compilations_after_warmup == 0
