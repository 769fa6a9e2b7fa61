"""The one matmul every projection goes through: a plain array or a qwix `QArray` weight.

Weight-only quantization: activations stay in the compute dtype, so the weight is dequantized
(values -> scale dtype, minus zero point, times the scale broadcast over its tile) and a
floating-point einsum runs; XLA can fuse that into the dot's operand. qwix does this for
symmetric leaves and is imported only when a quantized leaf is traced. Zero points are kept in the
scale's dtype (GPTQ v1's zero + 1 can be 16, which 4 bits cannot hold), which qwix's dequantize
refuses (it wants them in the values' type), so those leaves are dequantized here.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def _per_tile(fn: Any, values: jax.Array, tiles: jax.Array) -> jax.Array:
    """fn(values, tiles) with each element of `tiles` applied to its tile of `values`."""
    split, lifted = [], []
    for n, m in zip(values.shape, tiles.shape):
        split += [m, n // m]
        lifted += [m, 1]
    return fn(values.reshape(split), tiles.reshape(lifted)).reshape(values.shape)


def dequantize_with_zero(w: Any) -> jax.Array:
    """(values - zero_point) * scale, in the scale's dtype."""
    v = w.qvalue.astype(w.scale.dtype)
    return _per_tile(jnp.multiply, _per_tile(jnp.subtract, v, w.zero_point), w.scale)


def dense(w: Any, dtype: Any) -> Any:
    """A weight as plain values in `dtype`: a quantized leaf dequantized (its values times the scale
    over each tile, less the zero point), a plain one as it is. For the grouped matmuls, which take
    plain experts: a layer's quantized experts are widened inside the step, like packed MXFP4 ones."""
    if getattr(w, "qvalue", None) is None:
        return w
    if w.zero_point is not None:
        return dequantize_with_zero(w).astype(dtype)
    return _per_tile(jnp.multiply, w.qvalue.astype(dtype), w.scale.astype(dtype))


def _gather_inputs(equation: str, x: jax.Array, perm: jax.Array) -> jax.Array:
    """x with its contracted (trailing) axes, flattened, reordered by perm."""
    lhs, rest = equation.split(",")
    rhs, out = rest.split("->")
    n = sum(1 for c in lhs if c.isalpha() and c in rhs and c not in out)
    flat = x.reshape(*x.shape[: x.ndim - n], -1)
    return jnp.take(flat, perm, axis=-1).reshape(x.shape)


def einsum(equation: str, x: jax.Array, w: Any, **kwargs: Any) -> jax.Array:
    """jnp.einsum(equation, x, w) for a plain or quantized w (or one with its inputs in group order)."""
    if getattr(w, "perm", None) is not None:
        return einsum(equation, _gather_inputs(equation, x, w.perm), w.weight, **kwargs)
    if getattr(w, "qvalue", None) is None:
        return jnp.einsum(equation, x, w, **kwargs)
    if w.zero_point is not None:
        return jnp.einsum(equation, x, dequantize_with_zero(w), **kwargs)
    import qwix

    return qwix.einsum(equation, x, w, **kwargs)
