"""Gated DeltaNet, the linear-attention layer of Qwen3-Next and Qwen3.5, as a pure function.

A layer projects x to the conv's channels (q, k, v side by side), an output gate z and the per-head
write strength (b -> beta) and decay (a -> g); runs a causal depthwise conv with SiLU over the
channels; runs the gated delta rule over q, k, v (kernels_pallas/gated_delta_reference.py); then
a per-head RMSNorm gated by silu(z) and the output projection. Both the conv and the delta rule
carry state from one token to the next, so the two are a `Mixer`: the dense parity path runs each
sequence from a zero state (model/dense.py), the ragged step reads and writes each sequence's
state slot (model/paged.py, model/state_cache.py). Token axes are leading `...` axes.
"""

from __future__ import annotations

from typing import Protocol

import jax
import jax.numpy as jnp

from jaxserve.core.config import ModelConfig
from jaxserve.model.matmul import einsum
from jaxserve.model.weights import LayerWeights


class Mixer(Protocol):
    """What carries state along a sequence, for layer `i` (its index in the whole stack)."""

    def conv(self, i: int, x: jax.Array, weight: jax.Array) -> jax.Array:
        """x [..., C] -> silu(causal depthwise conv) [..., C]; weight [C, K]."""

    def delta(self, i: int, q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array,
              beta: jax.Array) -> jax.Array:
        """q, k [..., Hk, Dk]; v [..., Hv, Dv]; g, beta [..., Hv] -> o [..., Hv, Dv] (q's dtype)."""


def gated_rms_norm(x: jax.Array, z: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over x's last axis (x weight, in x's dtype), then x silu(z) in float32."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    h = weight * x32.astype(x.dtype)
    return (h.astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))).astype(x.dtype)


def gated_delta_net(cfg: ModelConfig, i: int, layer: LayerWeights, x: jax.Array, mixer: Mixer) -> jax.Array:
    """Layer i's token mixing: x [..., D] (normed) -> [..., D]."""
    lin = cfg.linear
    mixed = mixer.conv(i, einsum("...d,dc->...c", x, layer.lin_qkv), layer.lin_conv)
    q, k, v = jnp.split(mixed, [lin.key_dim, 2 * lin.key_dim], axis=-1)
    lead = mixed.shape[:-1]
    q = q.reshape(*lead, lin.num_k_heads, lin.k_head_dim)
    k = k.reshape(*lead, lin.num_k_heads, lin.k_head_dim)
    v = v.reshape(*lead, lin.num_v_heads, lin.v_head_dim)
    beta = jax.nn.sigmoid(einsum("...d,dh->...h", x, layer.lin_b))
    a = einsum("...d,dh->...h", x, layer.lin_a).astype(jnp.float32)
    # g = log of the per-token decay, <= 0; in float32 whatever the dtype (exp(A_log) overflows fp16)
    g = -jnp.exp(layer.lin_a_log.astype(jnp.float32)) * jax.nn.softplus(a + layer.lin_dt_bias.astype(jnp.float32))
    o = mixer.delta(i, q, k, v, g, beta)
    o = gated_rms_norm(o, einsum("...d,dhv->...hv", x, layer.lin_z), layer.lin_norm, cfg.rms_norm_eps)
    return einsum("...hv,hvd->...d", o, layer.lin_out)
