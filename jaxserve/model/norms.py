"""RMSNorm as every supported family computes it (in float32, the weight applied in the family's order)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, style: str = "llama", axes: int = 1) -> jax.Array:
    """RMSNorm over the last `axes` axes, computed in float32. style (ModelConfig.norm_style):
    "llama" casts back before the weight (transformers' Llama order), "float32" applies the weight
    in float32 then casts, "gemma" multiplies by (1 + weight) in float32 then casts."""
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32 * x32, axis=tuple(range(-axes, 0)), keepdims=True)
    x32 = x32 * jax.lax.rsqrt(mean + eps)
    if style == "llama":
        return weight * x32.astype(x.dtype)
    w32 = weight.astype(jnp.float32)
    return (x32 * (1.0 + w32 if style == "gemma" else w32)).astype(x.dtype)
