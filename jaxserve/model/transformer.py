"""The decoder-only transformer as one pure function over a weight pytree.

`forward` owns everything but attention over the cache: embeddings, RMSNorm, q/k/v projections
(with Qwen2 biases and Qwen3 q/k norms), RoPE, the SwiGLU MLP (or a sparse MoE block: model/moe.py)
and the lm_head. Attention is a
callable `attend(layer, q, k, v, cache) -> (out, cache)` so the same body serves the dense parity
path (`model/dense.py`) and the ragged paged step (`model/paged.py`). Token axes are leading
`...` axes: `[T]` for the ragged step, `[B, S]` for the dense path.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from jaxserve.core.config import ModelConfig
from jaxserve.model import lora as lora_apply
from jaxserve.model import rope
from jaxserve.model.matmul import einsum
from jaxserve.model.moe import moe_mlp
from jaxserve.model.weights import LayerWeights, Weights

# attend(layer_index, q [..., Hq, hd], k [..., Hkv, hd], v [..., Hkv, hd], cache) -> (out [..., Hq, hd], cache)
Attend = Callable[[int, jax.Array, jax.Array, jax.Array, Any], tuple[jax.Array, Any]]


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm computed in float32, cast back before the weight (transformers' order)."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * x32.astype(x.dtype)


def _add(x: jax.Array, bias: jax.Array | None) -> jax.Array:
    return x if bias is None else x + bias


def qkv(layer: LayerWeights, x: jax.Array, cos: jax.Array, sin: jax.Array, cfg: ModelConfig,
        lora: Any = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """lora: this layer's adapter factors and the tokens' slot one-hot (lora/apply.py), or None."""
    q = lora_apply.add(_add(einsum("...d,dhk->...hk", x, layer.wq), layer.bq), "q_proj", x, lora)
    k = lora_apply.add(_add(einsum("...d,dhk->...hk", x, layer.wk), layer.bk), "k_proj", x, lora)
    v = lora_apply.add(_add(einsum("...d,dhk->...hk", x, layer.wv), layer.bv), "v_proj", x, lora)
    if cfg.qk_norm:
        q = rms_norm(q, layer.q_norm, cfg.rms_norm_eps)
        k = rms_norm(k, layer.k_norm, cfg.rms_norm_eps)
    return rope.apply(q, cos, sin), rope.apply(k, cos, sin), v


def mlp(layer: LayerWeights, x: jax.Array, lora: Any = None) -> jax.Array:
    gate = lora_apply.add(_add(einsum("...d,df->...f", x, layer.w_gate), layer.b_gate), "gate_proj", x, lora)
    up = lora_apply.add(_add(einsum("...d,df->...f", x, layer.w_up), layer.b_up), "up_proj", x, lora)
    h = jax.nn.silu(gate) * up
    return lora_apply.add(_add(einsum("...f,fd->...d", h, layer.w_down), layer.b_down), "down_proj", h, lora)


def lm_head(weights: Weights, x: jax.Array) -> jax.Array:
    """x: [..., D] -> float32 logits [..., Vp] (padded vocabulary)."""
    if weights.lm_head is None:
        return jnp.einsum("...d,vd->...v", x, weights.embed, preferred_element_type=jnp.float32)
    return einsum("...d,dv->...v", x, weights.lm_head, preferred_element_type=jnp.float32)


def forward(weights: Weights, cfg: ModelConfig, tokens: jax.Array, positions: jax.Array,
            attend: Attend, caches: Sequence[Any], *, logits_index: jax.Array | None = None,
            seq_lens_per_token: jax.Array | None = None,
            lora: lora_apply.LoraInputs | None = None,
            aux_layers: tuple[int, ...] = (), moe_fn: Callable[..., jax.Array] | None = None) -> tuple[jax.Array, ...]:
    """tokens, positions: [...] int32. Returns (float32 logits, updated caches), and with
    `aux_layers` a third output: the residual stream entering each of those layers, concatenated
    in layer order ([..., len(aux_layers) * D]: what an EAGLE-3 head reads).

    logits_index: gather these rows of the flattened token axis before the lm_head, so a step
    computes logits only for the rows that sample ([R] -> logits [R, Vp]); None keeps every row.
    seq_lens_per_token: [...] each token's sequence length (dynamic RoPE only).
    lora: adapter slots and each token's slot one-hot [..., N] (multi-LoRA), or None.
    moe_fn: the sparse blocks' function (moe_mlp's signature): expert_parallel.make_moe's explicit
    dispatch for an expert-parallel layout; None: moe.moe_mlp, partitioned by XLA.
    """
    x = jnp.take(weights.embed, tokens, axis=0)
    cos, sin = rope.cos_sin(cfg, positions, seq_lens_per_token)
    new_caches, aux = [], []
    for i, layer in enumerate(weights.layers):
        if i in aux_layers:
            aux.append(x)
        lo = None if lora is None else (lora.layers[i], lora.one_hot)
        h = rms_norm(x, layer.attn_norm, cfg.rms_norm_eps)
        q, k, v = qkv(layer, h, cos, sin, cfg, lo)
        out, cache = attend(i, q, k, v, caches[i])
        new_caches.append(cache)
        out = out.astype(x.dtype)
        x = x + lora_apply.add(_add(einsum("...hk,hkd->...d", out, layer.wo), layer.bo), "o_proj", out, lo)
        h = rms_norm(x, layer.mlp_norm, cfg.rms_norm_eps)
        x = x + (mlp(layer, h, lo) if layer.router is None else (moe_fn or moe_mlp)(layer, h, cfg.moe))
    if logits_index is not None:
        x = jnp.take(x.reshape(-1, x.shape[-1]), logits_index, axis=0)
    x = rms_norm(x, weights.final_norm, cfg.rms_norm_eps)
    if aux_layers:
        return lm_head(weights, x), new_caches, jnp.concatenate(aux, axis=-1)
    return lm_head(weights, x), new_caches
