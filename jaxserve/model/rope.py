"""Rotary position embeddings as Hugging Face configs express them.

Supported `rope_type`s: default, linear (position interpolation), dynamic (NTK-aware, recomputed
from the current sequence length), llama3 (Llama 3.1 frequency bands) and yarn. The inverse
frequencies follow transformers' float32 arithmetic so that cos/sin agree to the last bits.
Rotation is the "rotate half" convention all four supported families use.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.core.config import ModelConfig
from jaxserve.core.layer_kinds import RopeConfig, yarn_mscale


def _base_exponents(dim: int) -> np.ndarray:
    return np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)


def _default_inv_freq(theta: float, dim: int) -> np.ndarray:
    return (1.0 / (np.float32(theta) ** _base_exponents(dim))).astype(np.float32)


def _llama3_inv_freq(rope: RopeConfig, dim: int) -> np.ndarray:
    inv_freq = _default_inv_freq(rope.theta, dim)
    old_len = rope.original_max_position_embeddings
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _yarn(rope: RopeConfig, dim: int) -> tuple[np.ndarray, float]:
    factor = rope.factor
    mscale = yarn_mscale
    if rope.attention_factor is not None:
        attention = float(rope.attention_factor)
    elif rope.mscale and rope.mscale_all_dim:
        attention = mscale(factor, rope.mscale) / mscale(factor, rope.mscale_all_dim)
    else:
        attention = mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi))) / (
            2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
    pos_freqs = (np.float32(rope.theta) ** _base_exponents(dim)).astype(np.float32)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (np.float32(factor) * pos_freqs)
    extrapolation_factor = 1 - ramp
    inv = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv.astype(np.float32), attention


def static_inv_freq(rope: RopeConfig, dim: int) -> tuple[np.ndarray, float]:
    """(inv_freq [dim/2] float32, cos/sin scaling) for every rope type but `dynamic`; dim: the
    rotated dims of a head."""
    if rope.rope_type == "default" or rope.rope_type == "dynamic":
        return _default_inv_freq(rope.theta, dim), 1.0
    if rope.rope_type == "linear":
        return (_default_inv_freq(rope.theta, dim) / np.float32(rope.factor)).astype(np.float32), 1.0
    if rope.rope_type == "llama3":
        return _llama3_inv_freq(rope, dim), 1.0
    if rope.rope_type == "yarn":
        return _yarn(rope, dim)
    raise ValueError(f"unsupported rope type {rope.rope_type!r}")


def _dynamic_inv_freq(rope: RopeConfig, dim: int, max_pos: int, seq_len: jax.Array) -> jax.Array:
    """NTK-aware base stretched for sequences longer than max_position_embeddings. seq_len: [...]."""
    length = jnp.maximum(seq_len, max_pos).astype(jnp.float32)
    base = rope.theta * ((rope.factor * length / max_pos) - (rope.factor - 1)) ** (dim / (dim - 2))
    return 1.0 / (base[..., None] ** jnp.asarray(_base_exponents(dim)))  # [..., dim/2]


def cos_sin(cfg: ModelConfig, positions: jax.Array, seq_lens: jax.Array | None = None,
            rope: RopeConfig | None = None) -> tuple[jax.Array, jax.Array]:
    """cos, sin of shape positions.shape + [rotary dims], float32, for `rope` (default: the model's).

    seq_lens (same shape as positions) is the length of each token's sequence; only the dynamic
    rope type reads it (transformers recomputes the base from it at every forward).
    """
    rope = cfg.rope if rope is None else rope
    dim = cfg.rotary_dim(rope)
    if rope.rope_type == "dynamic":
        if seq_lens is None:
            raise ValueError("dynamic RoPE needs the sequence length of every token")
        inv_freq, scale = _dynamic_inv_freq(rope, dim, cfg.max_position_embeddings, seq_lens), 1.0
    else:
        inv_np, scale = static_inv_freq(rope, dim)
        inv_freq = jnp.asarray(inv_np)
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [..., dim/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb) * scale, jnp.sin(emb) * scale


def apply(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x: [..., heads, head_dim]; cos/sin: [..., rotary dims] (broadcast over heads). Partial
    rotary (rotary dims < head_dim): the first dims rotate, the rest pass through."""
    dim = cos.shape[-1]
    if dim < x.shape[-1]:
        return jnp.concatenate([apply(x[..., :dim], cos, sin), x[..., dim:]], axis=-1)
    half = dim // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    cos, sin = cos[..., None, :].astype(x.dtype), sin[..., None, :].astype(x.dtype)
    return x * cos + rotated * sin
