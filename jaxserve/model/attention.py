"""Attention backend selection, and tensor-parallel placement of the Pallas kernels.

The jnp reference runs under plain jit sharding (XLA partitions it). A Pallas kernel is opaque to
XLA's partitioner, which would gather its sharded inputs onto every device; so when the model axis
splits the KV heads, the kernel is wrapped in `shard_map` over that axis: each device runs it on
its own q heads and the KV heads they read (GQA groups never straddle devices because both head
counts are split by the same factor). When the KV heads are replicated (model axis larger than
the KV head count, or not dividing it) a kernel cannot be placed that way, and the step runs the
tiled jnp path instead, which XLA partitions (a warning says so).
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Callable

import jax
from jax.sharding import Mesh, PartitionSpec as P

from jaxserve.parallel import sharding
from jaxserve.core.config import ModelConfig
from jaxserve.model.weights import logical_dims

AttentionFn = Callable[..., jax.Array]
logger = logging.getLogger("jaxserve.attention")


def make_attention(backend: str, cfg: ModelConfig, placement: sharding.Placement, **kernel_kwargs) -> AttentionFn:
    """The ragged paged attention function the step calls, placed as `placement` places the pool.

    kernel_kwargs go to the Pallas kernel (e.g. `interpret=True` to run a GPU kernel on CPU).
    """
    from kernels_pallas import (JNP_BACKENDS, attention_for_platform, get_attention_backend,
                                ragged_paged_attention_tiled)

    mesh, rules = placement

    # "auto" follows the mesh's devices (a compile-only TPU mesh gets the TPU kernel in a CPU process)
    fn = attention_for_platform(mesh.devices.flat[0].platform) if backend == "auto" else get_attention_backend(backend)
    if kernel_kwargs:
        fn = partial(fn, **kernel_kwargs)
    rules = sharding.rules_for(logical_dims(cfg), mesh, rules)
    kv_axis = rules.get("kv_heads")
    if fn in JNP_BACKENDS or mesh.size == 1:
        return fn
    if kv_axis is None or rules.get("q_heads") != kv_axis:
        # A Pallas kernel cannot be partitioned by XLA, and split q heads over whole (replicated) KV
        # heads would need each device to slice its KV head out of the pool every step. The jnp
        # path partitions like any XLA program: same numbers, slower than the kernel.
        logger.warning("%d KV heads do not split over the %d-way model axis: attention runs the jnp path, "
                       "not the %s kernel", cfg.num_kv_heads, mesh.shape[sharding.MODEL_AXIS],
                       getattr(fn, "__name__", backend))
        return ragged_paged_attention_tiled
    return _shard_over_heads(fn, mesh, kv_axis)


def _shard_over_heads(fn: AttentionFn, mesh: Mesh, axis: str) -> AttentionFn:
    heads = P(None, axis, None)               # q / out: [T, H, D]
    pages = P(None, None, axis, None)         # [P, ps, KVH, D]
    scales = P(None, axis, None)              # [P, KVH, ps] (quantized pages)
    sink_spec = P(axis)                       # [H] (attention sinks): split like q's heads
    meta = P()

    def wrapped(q, k_pages, v_pages, seq_lens, cu_q_lens, page_tables, num_seqs, *, sm_scale,
                sliding_window=None, soft_cap=None, k_scales=None, v_scales=None, sinks=None, v_head_dim=None):
        # optional operands (V pages: none when the values are K's rows; scales; sinks), by name
        named = {"v_pages": (v_pages, pages), "k_scales": (k_scales, scales), "v_scales": (v_scales, scales),
                 "sinks": (sinks, sink_spec)}
        present = [name for name, (x, _) in named.items() if x is not None]

        def inner(q, k_pages, seq_lens, cu_q_lens, page_tables, num_seqs, *extra_in):
            opt = {name: None for name in named} | dict(zip(present, extra_in))
            v = opt.pop("v_pages")
            return fn(q, k_pages, v, seq_lens, cu_q_lens, page_tables, num_seqs, sm_scale=sm_scale,
                      sliding_window=sliding_window, soft_cap=soft_cap, v_head_dim=v_head_dim, **opt)
        return jax.shard_map(inner, mesh=mesh,
                             in_specs=(heads, pages, meta, meta, meta, meta) + tuple(named[n][1] for n in present),
                             out_specs=heads, check_vma=False)(
            q, k_pages, seq_lens, cu_q_lens, page_tables, num_seqs, *(named[n][0] for n in present))

    wrapped.__name__ = f"shard_map_{getattr(fn, '__name__', 'attention')}"
    return wrapped
