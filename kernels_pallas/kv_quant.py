"""Quantized KV pages: the storage format every attention backend reads.

A quantized pool stores K and V pages as 8-bit values, [P, ps, KVH, D] int8 / float8, and one
float32 scale per (page slot, KV head): scales [P, KVH, ps] (heads before slots so that on a TPU
one head's scales of a page are a lane row, the orientation the kernel multiplies its logits by).
A value reads back as `value.astype(f32) * scale`. Scales are absmax per token and head: each
token's head vector is scaled to the format's largest finite value when it is written, so a
write never touches other slots (decode writes one slot per sequence, the page's other tokens keep
their scales) and no outlier token coarsens its neighbours. docs/BENCHMARKS.md ("KV cache
quantization") has the error against per-page scales that led to this choice.

Attention applies the scales to its logits and probabilities rather than to the pages:
`q . (k * s_k) = s_k (q . k)` and `sum_t p_t s_v,t v_t = (p * s_v) @ v`, so 8-bit pages are only
widened to the compute dtype (exact: every int8 and float8 value is a bfloat16) and the scales
cost one multiply per logit.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes

# storage dtype -> the largest magnitude a scaled value takes
QMAX = {
    jnp.dtype(jnp.int8): 127.0,
    jnp.dtype(ml_dtypes.float8_e4m3fn): float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max),  # 448
    jnp.dtype(ml_dtypes.float8_e5m2): float(ml_dtypes.finfo(ml_dtypes.float8_e5m2).max),  # 57344
}
SCALE_DTYPE = jnp.float32


def is_quantized(dtype) -> bool:
    """Whether pages of this dtype are quantized (need scales)."""
    return jnp.dtype(dtype) in QMAX


def quantize(x: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """x [..., D] float -> (values [..., D] dtype, scales [...] float32), absmax over D."""
    dtype = jnp.dtype(dtype)
    xf = x.astype(jnp.float32)
    absmax = jnp.max(jnp.abs(xf), axis=-1)
    scale = jnp.where(absmax > 0, absmax / QMAX[dtype], 1.0)
    # clipped: x / (absmax / qmax) can round past qmax, and float8 e4m3fn has no inf (it would be NaN)
    scaled = jnp.clip(xf / scale[..., None], -QMAX[dtype], QMAX[dtype])
    if jnp.issubdtype(dtype, jnp.integer):
        scaled = jnp.round(scaled)
    return scaled.astype(dtype), scale.astype(SCALE_DTYPE)


def dequantize_pages(pages: jax.Array, scales: jax.Array | None) -> jax.Array:
    """pages [P, ps, KVH, D] (+ scales [P, KVH, ps]) -> float32 [P, ps, KVH, D]."""
    out = pages.astype(jnp.float32)
    if scales is None:
        return out
    return out * jnp.swapaxes(scales, 1, 2)[..., None]


def gather_pages(pages: jax.Array, scales: jax.Array | None, ids: jax.Array) -> jax.Array:
    """The float32 K or V of page ids [..., n] in token order: [..., n * ps, KVH, D]."""
    _, ps, kvh, d = pages.shape
    out = pages[ids].astype(jnp.float32)                                        # [..., n, ps, KVH, D]
    if scales is not None:
        out = out * jnp.swapaxes(scales[ids], -1, -2)[..., None]                # [..., n, ps, KVH, 1]
    return out.reshape(*ids.shape[:-1], ids.shape[-1] * ps, kvh, d)
