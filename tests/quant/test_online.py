"""Online weight quantization (--quantization int8 | int4 | fp8): declaration, loading, numerics.

The exact oracle is the same model with every quantized leaf dequantized on the host into a plain
float32 array: the quantized forward must equal it up to float rounding (the matmul path is right).
The quality bound against the unquantized model is stated per scheme (random tiny models, where
int4 is per channel because the widths are below one group of 128).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from checkpoints import load_model, orbax_io
from hf_models import VARIANTS, make_hf_model
from jaxserve.core.config import ModelConfig
from jaxserve.model import weights as W
from jaxserve.model.dense import forward_dense, left_pad
from jaxserve.model.param_spec import ParamSpec
from jaxserve.quant import host
from jaxserve.model.quant_layout import flat_tile, tile_shape
from jaxserve.quant.scheme import ONLINE, WeightQuant, online_scheme
from jaxserve.server.commands import convert
from jaxserve.parallel.sharding import DATA_AXIS, make_mesh

# max |logit - f32 logit| / max |f32 logit| on the parity families (measured: int8 <= 0.010,
# fp8 <= 0.045, int4 <= 0.21)
BOUND = {"int8": 0.02, "fp8": 0.08, "int4": 0.35}
IDS = np.random.default_rng(1).integers(0, 96, size=(2, 40)).astype(np.int32)


def dequantized(weights: W.Weights) -> W.Weights:
    """Every quantized leaf -> its float32 dequantization (numpy), so a plain forward is the oracle."""
    def deq(leaf):
        if W.is_quantized(leaf):
            zero = None if leaf.zero_point is None else np.asarray(leaf.zero_point)
            return jnp.asarray(host.dequantize(np.asarray(leaf.qvalue), np.asarray(leaf.scale), zero))
        return leaf
    return jax.tree.map(deq, weights, is_leaf=W.is_quantized)


def logits(weights, cfg, ids=IDS):
    return np.asarray(forward_dense(weights, cfg, jnp.asarray(ids), jnp.ones_like(jnp.asarray(ids))))


def test_flat_tile_spans_heads_and_rejects_what_does_not_tile():
    assert flat_tile([8, 64], 128, "o_proj") == (2, 64)       # a group of 128 over two 64-wide heads
    assert flat_tile([8, 256], 128, "o_proj") == (1, 128)
    assert flat_tile([512], 128, "q_proj") == (128,)
    with pytest.raises(ValueError, match="o_proj: a group of 128 does not tile the axes \\(3, 96\\)"):
        flat_tile([3, 96], 128, "o_proj")


def test_tiles_per_scheme():
    wo = ParamSpec((8, 64, 256), jnp.float32, ("q_heads", "head_dim", "embed"), contract=(0, 1))
    assert tile_shape(wo, ONLINE["int8"], "o_proj") == (8, 64, 1)      # one scale per output channel
    assert tile_shape(wo, ONLINE["int4"], "o_proj") == (2, 64, 1)      # groups of 128 inputs
    block = WeightQuant("fp8", "float8_e4m3fn", block=(128, 128))
    assert tile_shape(wo, block, "o_proj") == (2, 64, 128)
    short = ParamSpec((64, 96), jnp.float32, ("embed", "mlp"), contract=(0,))
    assert tile_shape(short, ONLINE["int4"], "gate_proj") == (64, 1)   # shorter than a group: one group
    odd = ParamSpec((192, 96), jnp.float32, ("mlp", "embed"), contract=(0,))
    with pytest.raises(ValueError, match="down_proj: 192 input features are not a multiple of the int4 group size 128"):
        tile_shape(odd, ONLINE["int4"], "down_proj")


def test_unknown_scheme_is_named():
    with pytest.raises(ValueError, match="unknown --quantization 'int3'; choose one of int8, int4, fp8"):
        online_scheme("int3")


@pytest.mark.parametrize("qtype", ["int8", "int4", "float8_e4m3fn"])
def test_host_quantization_error_is_within_half_a_step(qtype):
    w = np.random.default_rng(0).standard_normal((256, 48)).astype(np.float32)
    values, scale = host.quantize(w, ml_dtypes.int4 if qtype == "int4" else np.dtype(qtype), (2, 48))
    assert values.dtype == np.dtype(ml_dtypes.int4 if qtype == "int4" else qtype)
    assert scale.shape == (2, 48)
    err = np.abs(host.dequantize(values, scale) - w)
    step = host.broadcast_scale(scale, w.shape)
    if qtype == "float8_e4m3fn":  # 3 mantissa bits: relative error <= 2^-4
        assert np.all(err <= np.abs(w) * 2 ** -4 + step * 2 ** -9)
    else:
        assert np.all(err <= step / 2 + 1e-7)
    # absmax maps to the type's largest value exactly
    top = host.qmax(values.dtype)
    assert np.isclose(np.abs(values.astype(np.float32)).max(), top)


def test_declaration_gives_quantized_leaves_and_their_shardings():
    cfg = ModelConfig.from_hf(dict(architectures=["Qwen3ForCausalLM"], vocab_size=1000, hidden_size=256,
                                   intermediate_size=512, num_hidden_layers=1, num_attention_heads=8,
                                   num_key_value_heads=8, head_dim=32, max_position_embeddings=64))
    cfg = dataclasses.replace(cfg, quantization=ONLINE["int4"])
    specs = W.abstract(cfg, jnp.bfloat16)
    wq, wo = specs.layers[0].wq, specs.layers[0].wo
    assert (wq.qvalue.shape, wq.qvalue.dtype, wq.scale.shape, wq.scale.dtype) == \
        ((256, 8, 32), np.dtype(ml_dtypes.int4), (2, 8, 32), jnp.bfloat16)
    assert wo.scale.shape == (2, 1, 256) and wo.scale.axes == ("q_heads", None, "embed")
    assert specs.embed.dtype == jnp.bfloat16 and not W.is_quantized(specs.embed)
    mesh = make_mesh(1, 8)
    shards = W.shardings(specs, cfg, mesh)
    assert shards.layers[0].wq.qvalue.spec == PartitionSpec(None, "model", None)
    assert shards.layers[0].wq.scale.spec == PartitionSpec(None, "model", None)
    assert shards.layers[0].wo.scale.spec == PartitionSpec(None, None, None)   # 2 groups on an 8-way axis
    assert shards.layers[0].w_down.scale.spec == PartitionSpec(None, None)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_family_equals_its_dequantized_weights_and_stays_near_f32(variant, tmp_path):
    path, _ = make_hf_model(variant, tmp_path)
    cfg, weights = load_model(path, make_mesh(1, 1))
    ref = logits(weights, cfg)
    for name in ONLINE:
        qcfg, qweights = load_model(path, make_mesh(1, 1), quantization=name)
        assert qcfg.quantization == ONLINE[name]
        assert W.is_quantized(qweights.layers[0].w_down)
        assert qweights.layers[0].w_down.qvalue.dtype == ONLINE[name].dtype
        ours = logits(qweights, qcfg)
        oracle = logits(dequantized(qweights), cfg)
        np.testing.assert_allclose(ours, oracle, rtol=0, atol=1e-5 * np.abs(oracle).max())
        rel = np.abs(ours - ref).max() / np.abs(ref).max()
        assert rel <= BOUND[name], f"{name}: max logit error {rel:.4f} of max |logit|"
        assert 0 < rel  # the weights really changed


@pytest.fixture(scope="module")
def grouped(tmp_path_factory):
    """Wide enough for real groups of 128: hidden 256, intermediate 384, head_dim 64 (a group spans two
    o_proj heads)."""
    return make_hf_model("qwen3-untied", tmp_path_factory.mktemp("grouped"), hidden_size=256,
                         intermediate_size=384, head_dim=64, num_attention_heads=4, num_key_value_heads=2)


def test_int4_groups_of_128_and_quantized_untied_lm_head_stays_plain(grouped):
    path, _ = grouped
    cfg, weights = load_model(path, make_mesh(1, 1), quantization="int4")
    layer = weights.layers[0]
    assert layer.wq.scale.shape == (2, 4, 64) and layer.wo.scale.shape == (2, 1, 256)
    assert layer.w_down.scale.shape == (3, 256)
    assert not W.is_quantized(weights.lm_head)
    oracle = logits(dequantized(weights), dataclasses.replace(cfg, quantization=None))
    np.testing.assert_allclose(logits(weights, cfg), oracle, rtol=0, atol=1e-5 * np.abs(oracle).max())


@pytest.mark.parametrize("name", list(ONLINE))
@pytest.mark.parametrize("data,model_axis", [(1, 2), (1, 8), (2, 4)])
def test_sharded_equals_unsharded(grouped, name, data, model_axis):
    path, _ = grouped
    cfg, single = load_model(path, make_mesh(1, 1), quantization=name)
    mesh = make_mesh(data, model_axis)
    _, sharded = load_model(path, mesh, quantization=name)
    split = "model" if cfg.num_heads % model_axis == 0 else None  # 4 heads: not on an 8-way axis
    assert sharded.layers[0].wq.qvalue.sharding.spec == PartitionSpec(None, split, None)
    assert sharded.layers[0].w_up.qvalue.sharding.spec == PartitionSpec(None, "model")
    prompts = [[5, 17, 33, 2, 9, 41, 7, 3], [60, 3, 3, 88], [14, 90, 31, 5, 5], [1, 2, 3, 4, 5, 6]]
    ids, mask = left_pad(prompts, 8)
    batch = NamedSharding(mesh, PartitionSpec(DATA_AXIS, None))
    ours = np.asarray(forward_dense(sharded, cfg, jax.device_put(jnp.asarray(ids), batch),
                                    jax.device_put(jnp.asarray(mask), batch)))
    ref = np.asarray(forward_dense(single, cfg, jnp.asarray(ids), jnp.asarray(mask)))
    valid = mask.astype(bool)
    np.testing.assert_allclose(ours[valid], ref[valid], rtol=0, atol=1e-5 * np.abs(ref).max())


@pytest.mark.parametrize("name", list(ONLINE))
def test_orbax_round_trip_is_exact(grouped, name, tmp_path):
    path, _ = grouped
    dst = convert(str(path), str(tmp_path / "converted"), quantization=name)
    assert orbax_io.saved_quantization(dst) == ONLINE[name]
    cfg, loaded = load_model(path, make_mesh(1, 1), quantization=name)
    rcfg, restored = load_model(dst, make_mesh(1, 2))  # the scheme comes from the converted directory
    assert rcfg == cfg
    a, b = jax.tree.leaves(loaded), jax.tree.leaves(restored)
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert np.array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))
    with pytest.raises(ValueError, match="was converted with " + name + "; convert it again with --quantization"):
        load_model(dst, make_mesh(1, 1), quantization="int8" if name != "int8" else "fp8")
