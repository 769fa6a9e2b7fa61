"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2) in its absorbed form, over any `attend`.

A token's K/V is one latent row: c = RMSNorm(x W_kv_a[:L]) [L] and a RoPE key k_r = rope(x W_kv_a[L:])
[R] shared by all heads; head h's key is [c W_uk[h], k_r] and its value c W_uv[h]. Since
q_h . k_h = (q_nope_h W_uk[h]^T) . c + q_rope_h . k_r, the up-projection W_uk is absorbed into the
query: head h attends with q_abs_h = [q_nope_h W_uk[h]^T, q_rope_h] ([L + R]) over the latent rows
[c, k_r] as MQA's single K head, with the rows' first L lanes as its values, and W_uv is applied to
its output. So the cache holds L + R numbers per token and layer whatever the head count, and every
ragged paged attention backend serves it as a one-KV-head attention of head_dim L + R whose values
are read from the same rows (`v_pages=None, v_head_dim=L`: each latent page read once; model/paged.py).
An `attend` that is given the latent as V too returns L + R lanes; the ones past L are dropped. The
latent is broadcast to cfg.num_kv_heads copies: 1, or the model axis's width when tensor parallelism
duplicates KV heads (parallel/kv_heads.py), so that each device holds the whole latent next to its
own query heads.

The expanded form (K and V up-projected per head, attention at head_dim Dqk) computes the same
numbers with fewer FLOPs for long prefills; this file serves both kinds of rows absorbed.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from jaxserve.core.config import ModelConfig
from jaxserve.model import rope
from jaxserve.model.matmul import einsum
from jaxserve.model.norms import rms_norm

# DeepSeek's modeling code builds the q_a and kv_a RMSNorms with their default epsilon, not the config's
LATENT_NORM_EPS = 1e-6

# attend(q [..., Hq, L + R], latent [..., Hkv, L + R]) -> (out [..., Hq, L + R], cache)
AttendLatent = Callable[[jax.Array, jax.Array], tuple[jax.Array, Any]]


def _rms_norm(x: jax.Array, weight: jax.Array) -> jax.Array:
    return rms_norm(x, weight, LATENT_NORM_EPS)


def queries_and_latent(layer: Any, x: jax.Array, rotary: tuple[jax.Array, jax.Array], cfg: ModelConfig
                       ) -> tuple[jax.Array, jax.Array]:
    """x [..., D] -> (absorbed queries [..., Hq, L + R], latent rows [..., Hkv, L + R])."""
    m = cfg.mla
    if layer.wq_a is not None:
        x_q = _rms_norm(einsum("...d,dr->...r", x, layer.wq_a), layer.q_a_norm)
        q = einsum("...r,rhk->...hk", x_q, layer.wq)                    # [..., Hq, Dn + R]
    else:
        q = einsum("...d,dhk->...hk", x, layer.wq)
    q_nope, q_rope = q[..., :m.qk_nope_head_dim], q[..., m.qk_nope_head_dim:]
    kv = einsum("...d,dc->...c", x, layer.wkv_a)                        # [..., L + R]
    latent = _rms_norm(kv[..., :m.kv_lora_rank], layer.kv_a_norm)
    k_rope = rope.apply(kv[..., None, m.kv_lora_rank:], *rotary)        # [..., 1, R]
    q_latent = jnp.einsum("...hn,lhn->...hl", q_nope, layer.w_uk.astype(q_nope.dtype))  # W_uk absorbed
    queries = jnp.concatenate([q_latent, rope.apply(q_rope, *rotary)], axis=-1)
    row = jnp.concatenate([latent[..., None, :], k_rope.astype(latent.dtype)], axis=-1)  # [..., 1, L + R]
    return queries, jnp.broadcast_to(row, (*row.shape[:-2], cfg.num_kv_heads, m.latent_dim))


def attention(layer: Any, x: jax.Array, rotary: tuple[jax.Array, jax.Array], cfg: ModelConfig,
              attend: AttendLatent) -> tuple[jax.Array, Any]:
    """One latent-attention block: x [..., D] -> (its output [..., D] before the residual, cache)."""
    queries, latent = queries_and_latent(layer, x, rotary, cfg)
    out, cache = attend(queries, latent)
    per_head = jnp.einsum("...hl,lhv->...hv", out[..., :cfg.mla.kv_lora_rank].astype(x.dtype),
                          layer.w_uv.astype(x.dtype))                   # [..., Hq, Dv]
    return einsum("...hv,hvd->...d", per_head, layer.wo), cache
