"""A Pallas kernel under tensor parallelism runs per device on its own heads (shard_map) and gives
the same result as the reference on the whole arrays."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxserve.core.config import ModelConfig
from jaxserve.model.attention import make_attention
from jaxserve.parallel.sharding import make_mesh, Placement
from kernels_pallas import (ragged_paged_attention_gpu, ragged_paged_attention_reference,
                            ragged_paged_attention_tiled)

CFG = ModelConfig.from_hf(dict(architectures=["LlamaForCausalLM"], vocab_size=128, hidden_size=64,
                               intermediate_size=64, num_hidden_layers=1, num_attention_heads=8,
                               num_key_value_heads=4, head_dim=16, max_position_embeddings=64))


def _inputs(rng):
    num_pages, ps = 12, 4
    q = rng.standard_normal((7, 8, 16)).astype(np.float32)
    k = rng.standard_normal((num_pages, ps, 4, 16)).astype(np.float32)
    v = rng.standard_normal((num_pages, ps, 4, 16)).astype(np.float32)
    seq_lens = np.array([9, 5], np.int32)          # a 4-token chunk and a 3-token chunk
    cu = np.array([0, 4, 7], np.int32)
    tables = np.array([[3, 7, 1, 0], [10, 2, 0, 0]], np.int32)
    return q, k, v, seq_lens, cu, tables, np.array([2], np.int32)


def test_gpu_kernel_shard_mapped_over_kv_heads_matches_reference():
    mesh = make_mesh(1, 4)  # 4 KV heads split 4 ways, 2 q heads per device
    fn = make_attention("gpu", CFG, Placement(mesh), interpret=True)
    assert fn.__name__.startswith("shard_map_")
    q, k, v, seq_lens, cu, tables, n = _inputs(np.random.default_rng(0))
    heads = NamedSharding(mesh, P(None, "model", None))
    pages = NamedSharding(mesh, P(None, None, "model", None))
    out = jax.jit(lambda *a: fn(*a, sm_scale=0.25))(jax.device_put(q, heads), jax.device_put(k, pages),
                                                     jax.device_put(v, pages), seq_lens, cu, tables, n)
    assert out.sharding.spec == P(None, "model", None)
    ref = ragged_paged_attention_reference(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), seq_lens, cu, tables,
                                           n, sm_scale=0.25)
    np.testing.assert_allclose(np.asarray(out)[:7], np.asarray(ref)[:7], rtol=1e-5, atol=1e-5)


def test_quantized_pages_and_their_scales_are_shard_mapped_over_kv_heads():
    """int8 pages with per-token scales [P, KVH, ps]: the scales split over the heads like the pages."""
    from kernels_pallas.kv_quant import dequantize_pages, quantize

    mesh = make_mesh(1, 4)
    fn = make_attention("gpu", CFG, Placement(mesh), interpret=True)
    q, k, v, seq_lens, cu, tables, n = _inputs(np.random.default_rng(1))
    (kq, ks), (vq, vs) = (quantize(jnp.asarray(x), jnp.int8) for x in (k, v))
    ks, vs = jnp.swapaxes(ks, 1, 2), jnp.swapaxes(vs, 1, 2)                       # [P, KVH, ps]
    pages = NamedSharding(mesh, P(None, None, "model", None))
    scales = NamedSharding(mesh, P(None, "model", None))
    out = jax.jit(lambda q, k, v, ks, vs: fn(q, k, v, seq_lens, cu, tables, n, sm_scale=0.25, k_scales=ks,
                                             v_scales=vs))(
        jax.device_put(q, NamedSharding(mesh, P(None, "model", None))), jax.device_put(kq, pages),
        jax.device_put(vq, pages), jax.device_put(ks, scales), jax.device_put(vs, scales))
    ref = ragged_paged_attention_reference(jnp.asarray(q), dequantize_pages(kq, ks), dequantize_pages(vq, vs),
                                           seq_lens, cu, tables, n, sm_scale=0.25)
    np.testing.assert_allclose(np.asarray(out)[:7], np.asarray(ref)[:7], rtol=1e-5, atol=1e-5)


def test_reference_stays_unwrapped_and_replicated_kv_heads_take_the_jnp_path(caplog):
    assert make_attention("reference", CFG, Placement(make_mesh(1, 4))) is ragged_paged_attention_reference
    # 8-way model axis > 4 KV heads: KV replicated; a kernel cannot be partitioned by XLA nor
    # shard-mapped over whole KV heads, so the step takes the jnp path, which XLA partitions.
    assert make_attention("gpu", CFG, Placement(make_mesh(1, 8)), interpret=True) is ragged_paged_attention_tiled
    assert "4 KV heads do not split over the 8-way model axis" in caplog.text
    assert make_attention("gpu", CFG, Placement(make_mesh(1, 1)), interpret=True).func is ragged_paged_attention_gpu


def test_auto_on_cpu_devices_shard_maps_the_native_decode_kernel_over_kv_heads():
    """On a CPU mesh "auto" is the tiled path with the native decode kernel, which XLA cannot
    partition: under a 4-way model axis it runs per device on its own heads, and a step with
    decodes and a chunk equals the reference on the whole arrays."""
    from kernels_pallas import ragged_paged_attention_cpu

    mesh = make_mesh(1, 4)
    fn = make_attention("auto", CFG, Placement(mesh))
    assert fn.__name__ == "shard_map_ragged_paged_attention_cpu"
    assert make_attention("auto", CFG, Placement(make_mesh(1, 1))) is ragged_paged_attention_cpu
    q, k, v, _, _, _, _ = _inputs(np.random.default_rng(2))
    seq_lens = np.array([9, 5, 6], np.int32)         # a 4-token chunk, then two decodes
    cu = np.array([0, 4, 5, 6], np.int32)
    tables = np.array([[3, 7, 1, 0], [10, 2, 0, 0], [4, 8, 0, 0]], np.int32)
    n = np.array([3], np.int32)
    heads = NamedSharding(mesh, P(None, "model", None))
    pages = NamedSharding(mesh, P(None, None, "model", None))
    step = jax.jit(lambda *a: fn(*a, sm_scale=0.25))
    assert "jaxserve_cpu_decode_attention" in step.lower(jax.device_put(q, heads), jax.device_put(k, pages),
                                                        jax.device_put(v, pages), seq_lens, cu, tables, n).as_text()
    out = step(jax.device_put(q, heads), jax.device_put(k, pages), jax.device_put(v, pages), seq_lens, cu, tables, n)
    ref = ragged_paged_attention_reference(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), seq_lens, cu, tables,
                                           n, sm_scale=0.25)
    np.testing.assert_allclose(np.asarray(out)[:6], np.asarray(ref)[:6], rtol=1e-5, atol=1e-5)
