"""Kernels for jaxserve: ragged paged attention on TPU (Mosaic), GPU (Triton), CPU (tiled jnp with a
native decode kernel through jax.ffi) and a jnp reference.

`ragged_paged_attention(...)` picks the backend from `jax.default_backend()`;
`get_attention_backend(name)` returns one explicitly. All backends share the signature pinned in
docs/CONTRACTS.md ("Ragged paged attention"). This package imports nothing from jaxserve.
"""
from __future__ import annotations

from typing import Callable

import jax

from kernels_pallas import cpu_decode_attention
from kernels_pallas.cpu_decode_attention import ragged_paged_attention_cpu
from kernels_pallas.gpu_blocks import supports as gpu_supports
from kernels_pallas.ragged_paged_attention_gpu import ragged_paged_attention_gpu
from kernels_pallas.ragged_paged_attention_reference import ragged_paged_attention_reference
from kernels_pallas.ragged_paged_attention_tiled import ragged_paged_attention_tiled
from kernels_pallas.ragged_paged_attention_tpu import ragged_paged_attention_tpu

AttentionFn = Callable[..., jax.Array]

BACKENDS = ("reference", "tiled", "cpu", "tpu", "gpu", "auto")
# Plain-jnp backends: XLA partitions them under jit sharding (no shard_map needed).
JNP_BACKENDS = (ragged_paged_attention_reference, ragged_paged_attention_tiled)


def _gpu_or_reference(q, k_pages, *args, **kwargs) -> jax.Array:
    """GPU kernel when it handles the head_dim/page_size, else the reference (same numbers)."""
    if gpu_supports(head_dim=k_pages.shape[-1], page_size=k_pages.shape[1], v_head_dim=kwargs.get("v_head_dim")):
        return ragged_paged_attention_gpu(q, k_pages, *args, **kwargs)
    return ragged_paged_attention_reference(q, k_pages, *args, **kwargs)


def get_attention_backend(name: str) -> AttentionFn:
    """"reference" | "tiled" | "cpu" | "tpu" | "gpu" | "auto" (by jax.default_backend() at call time)."""
    if name == "reference":
        return ragged_paged_attention_reference
    if name == "tiled":
        return ragged_paged_attention_tiled
    if name == "cpu":
        if not cpu_decode_attention.available():
            raise ValueError("attention backend 'cpu' needs its native decode kernel, which did not build here "
                             "(a C++ compiler on PATH, or $CXX; the log says why); 'tiled' runs without it")
        return ragged_paged_attention_cpu
    if name == "tpu":
        return ragged_paged_attention_tpu
    if name == "gpu":
        return ragged_paged_attention_gpu
    if name == "auto":
        return ragged_paged_attention
    raise ValueError(f"unknown attention backend {name!r}; expected one of {BACKENDS}")


def attention_for_platform(platform: str) -> AttentionFn:
    """The attention a platform serves with: "tpu" -> Mosaic kernel, "gpu"/"cuda"/"rocm" -> Triton
    kernel (reference where it does not take the shape), "cpu" -> the tiled path with the native
    decode kernel (the tiled jnp path alone where it did not build), anything else -> the tiled path.
    Chosen from the devices' platform, not the process's default backend, so a program lowered
    for a compile-only TPU or GPU from a CPU process gets the kernel that target would run."""
    if platform == "tpu":
        return ragged_paged_attention_tpu
    if platform in ("gpu", "cuda", "rocm"):
        return _gpu_or_reference
    if platform == "cpu" and cpu_decode_attention.available():
        return ragged_paged_attention_cpu
    return ragged_paged_attention_tiled


def ragged_paged_attention(
    q: jax.Array,  # [T, H, D]
    k_pages: jax.Array,  # [P, ps, KVH, D]
    v_pages: jax.Array | None,  # [P, ps, KVH, D], or None: the values are K's rows (v_head_dim lanes)
    seq_lens: jax.Array,  # [S] int32
    cu_q_lens: jax.Array,  # [S + 1] int32
    page_tables: jax.Array,  # [S, MP] int32
    num_seqs: jax.Array,  # [1] int32
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    k_scales: jax.Array | None = None,  # [P, KVH, ps] float32 for quantized pages (kv_quant.py)
    v_scales: jax.Array | None = None,
    sinks: jax.Array | None = None,  # [H] float32: one value-less logit per q head (gpt-oss)
    v_head_dim: int | None = None,
) -> jax.Array:  # [T, H, Dv]
    """Ragged paged attention on the default backend: tpu -> Mosaic kernel, gpu -> Triton kernel,
    anything else -> the tiled jnp path (same numbers as the reference; decodes batched, prefill
    chunks in tiles of their own rows)."""
    return attention_for_platform(jax.default_backend())(
        q, k_pages, v_pages, seq_lens, cu_q_lens, page_tables, num_seqs,
        sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
        k_scales=k_scales, v_scales=v_scales, sinks=sinks, v_head_dim=v_head_dim)


__all__ = [
    "BACKENDS",
    "attention_for_platform",
    "get_attention_backend",
    "ragged_paged_attention",
    "ragged_paged_attention_cpu",
    "ragged_paged_attention_gpu",
    "ragged_paged_attention_reference",
    "ragged_paged_attention_tiled",
    "JNP_BACKENDS",
    "ragged_paged_attention_tpu",
]
