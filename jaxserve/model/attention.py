"""Attention backend selection, and tensor-parallel placement of the Pallas kernels.

The jnp reference runs under plain jit sharding (XLA partitions it). A Pallas kernel is opaque to
XLA's partitioner, which would gather its sharded inputs onto every device; so when the model axis
splits the KV heads, the kernel is wrapped in `shard_map` over that axis: each device runs it on
its own q heads and the KV heads they read (GQA groups never straddle devices because both head
counts are split by the same factor). When the KV heads are replicated (model axis larger than
the KV head count) the kernel runs unwrapped and XLA replicates the work.
"""

from __future__ import annotations

from functools import partial
from typing import Callable

import jax
from jax.sharding import Mesh, PartitionSpec as P

from jaxserve import sharding
from jaxserve.config import ModelConfig
from jaxserve.model.weights import logical_dims

AttentionFn = Callable[..., jax.Array]


def make_attention(backend: str, cfg: ModelConfig, mesh: Mesh, **kernel_kwargs) -> AttentionFn:
    """The ragged paged attention function the step calls, placed for `mesh`.

    kernel_kwargs go to the Pallas kernel (e.g. `interpret=True` to run a GPU kernel on CPU).
    """
    from kernels_pallas import JNP_BACKENDS, get_attention_backend

    if backend == "auto" and jax.default_backend() not in ("tpu", "gpu"):
        backend = "tiled"  # resolve now, so the jnp path is recognised below
    fn = get_attention_backend(backend)
    if kernel_kwargs:
        fn = partial(fn, **kernel_kwargs)
    rules = sharding.rules_for(logical_dims(cfg), mesh)
    kv_axis = rules.get("kv_heads")
    if fn in JNP_BACKENDS or kv_axis is None or rules.get("q_heads") != kv_axis:
        return fn
    return _shard_over_heads(fn, mesh, kv_axis)


def _shard_over_heads(fn: AttentionFn, mesh: Mesh, axis: str) -> AttentionFn:
    heads = P(None, axis, None)               # q / out: [T, H, D]
    pages = P(None, None, axis, None)         # [P, ps, KVH, D]
    meta = P()

    def wrapped(q, k_pages, v_pages, seq_lens, cu_q_lens, page_tables, num_seqs, *, sm_scale,
                sliding_window=None, soft_cap=None):
        inner = partial(fn, sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)
        return jax.shard_map(inner, mesh=mesh, in_specs=(heads, pages, pages, meta, meta, meta, meta),
                             out_specs=heads, check_vma=False)(
            q, k_pages, v_pages, seq_lens, cu_q_lens, page_tables, num_seqs)

    wrapped.__name__ = f"shard_map_{getattr(fn, '__name__', 'attention')}"
    return wrapped
