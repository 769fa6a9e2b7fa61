"""The decoder-only transformer as one pure function over a weight pytree.

`forward` owns everything but attention over the cache: embeddings (scaled for Gemma), RMSNorm
where the family puts it (before each block, around it, or after it), q/k/v projections (with
Qwen2 biases and q/k norms; DeepSeek's latent attention instead: model/mla.py), each layer's RoPE
(its own base, partial, or none: cfg.layers), the gated MLP (or a sparse MoE block:
model/moe.py), the lm_head and its soft-cap. Attention is a callable
`attend(layer, q, k, v, cache) -> (out, cache)` so the same body serves the dense parity path
(`model/dense.py`) and the ragged paged step (`model/paged.py`); a hybrid stack's linear-attention
layers (model/linear_attention.py) take a `Mixer` the same way. Token axes are leading
`...` axes: `[T]` for the ragged step, `[B, S]` for the dense path.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from jaxserve.core.config import ModelConfig
from jaxserve.model import lora as lora_apply
from jaxserve.model import linear_attention, mla, rope
from jaxserve.model.matmul import einsum
from jaxserve.model.moe import moe_mlp
from jaxserve.model.norms import rms_norm
from jaxserve.model.weights import LayerWeights, Weights

# attend(layer_index, q [..., Hq, hd], k [..., Hkv, hd], v [..., Hkv, hd], cache, sinks=[Hq] | None)
#   -> (out [..., Hq, hd], cache)
Attend = Callable[[int, jax.Array, jax.Array, jax.Array, Any], tuple[jax.Array, Any]]


def norm(cfg: ModelConfig, x: jax.Array, weight: jax.Array, axes: int = 1) -> jax.Array:
    """The model's RMSNorm (its epsilon and style)."""
    return rms_norm(x, weight, cfg.rms_norm_eps, cfg.norm_style, axes)


def soft_cap(x: jax.Array, cap: float | None) -> jax.Array:
    return x if cap is None else jnp.tanh(x / cap) * cap


def _add(x: jax.Array, bias: jax.Array | None) -> jax.Array:
    return x if bias is None else x + bias


def qkv(layer: LayerWeights, x: jax.Array, rotary: tuple[jax.Array, jax.Array] | None, cfg: ModelConfig,
        lora: Any = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """rotary: this layer's (cos, sin), None on a layer without RoPE; lora: this layer's adapter
    factors and the tokens' slot one-hot (lora/apply.py), or None."""
    q = lora_apply.add(_add(einsum("...d,dhk->...hk", x, layer.wq), layer.bq), "q_proj", x, lora)
    k = lora_apply.add(_add(einsum("...d,dhk->...hk", x, layer.wk), layer.bk), "k_proj", x, lora)
    v = lora_apply.add(_add(einsum("...d,dhk->...hk", x, layer.wv), layer.bv), "v_proj", x, lora)
    if cfg.qk_norm:  # over each head, or over the whole projection ([H, hd] norm weights)
        axes = 2 if cfg.qk_norm == "projection" else 1
        q, k = norm(cfg, q, layer.q_norm, axes), norm(cfg, k, layer.k_norm, axes)
    if rotary is None:
        return q, k, v
    return rope.apply(q, *rotary), rope.apply(k, *rotary), v


_ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True)}


def mlp(layer: LayerWeights, x: jax.Array, lora: Any = None, act: str = "silu") -> jax.Array:
    gate = lora_apply.add(_add(einsum("...d,df->...f", x, layer.w_gate), layer.b_gate), "gate_proj", x, lora)
    up = lora_apply.add(_add(einsum("...d,df->...f", x, layer.w_up), layer.b_up), "up_proj", x, lora)
    h = _ACTIVATIONS[act](gate) * up
    return lora_apply.add(_add(einsum("...f,fd->...d", h, layer.w_down), layer.b_down), "down_proj", h, lora)


def lm_head(weights: Weights, x: jax.Array) -> jax.Array:
    """x: [..., D] -> float32 logits [..., Vp] (padded vocabulary)."""
    if weights.lm_head is None:
        return jnp.einsum("...d,vd->...v", x, weights.embed, preferred_element_type=jnp.float32)
    return einsum("...d,dv->...v", x, weights.lm_head, preferred_element_type=jnp.float32)


def rotary_tables(cfg: ModelConfig, positions: jax.Array, seq_lens: jax.Array | None = None
                  ) -> dict[Any, tuple[jax.Array, jax.Array]]:
    """RopeConfig -> (cos, sin) for every RoPE of the stack: layers that share a RoPE share its
    tables (made in layer order, not set order: the traced program must not depend on the
    process's hash seed)."""
    return {kind: rope.cos_sin(cfg, positions, seq_lens, kind)
            for kind in dict.fromkeys(k.rope for k in cfg.layers if k.rope is not None)}


def decoder_layer(cfg: ModelConfig, i: int, layer: LayerWeights, x: jax.Array,
                  rotary: dict[Any, tuple[jax.Array, jax.Array]], attend: Attend, cache: Any, lora: Any = None,
                  moe_fn: Callable[..., jax.Array] | None = None,
                  mixer: linear_attention.Mixer | None = None) -> tuple[jax.Array, Any]:
    """Layer i of the stack: x [..., D] -> (x after its attention and MLP blocks, its cache)."""
    pre, post = cfg.norm_placement != "post", cfg.norm_placement != "pre"
    h = norm(cfg, x, layer.attn_norm) if pre else x
    if cfg.layers[i].linear:
        h = linear_attention.gated_delta_net(cfg, i, layer, h, mixer)
    elif cfg.mla is not None:  # the latent is this attention's only K and V head (model/mla.py)
        h, cache = mla.attention(layer, h, rotary[cfg.layers[i].rope], cfg,
                                 lambda q, latent: attend(i, q, latent, latent, cache))
    else:
        q, k, v = qkv(layer, h, rotary.get(cfg.layers[i].rope), cfg, lora)
        out, cache = attend(i, q, k, v, cache, sinks=layer.sinks)
        out = out.astype(x.dtype)
        if layer.wq_gate is not None:  # gated attention (Qwen3-Next): each head's output x sigmoid(gate)
            out = out * jax.nn.sigmoid(einsum("...d,dhk->...hk", h, layer.wq_gate))
        h = lora_apply.add(_add(einsum("...hk,hkd->...d", out, layer.wo), layer.bo), "o_proj", out, lora)
    x = x + (norm(cfg, h, layer.post_attn_norm) if post else h)
    h = norm(cfg, x, layer.mlp_norm) if pre else x
    h = mlp(layer, h, lora, cfg.mlp_act) if layer.router is None else (moe_fn or moe_mlp)(layer, h, cfg.moe)
    return x + (norm(cfg, h, layer.post_mlp_norm) if post else h), cache


def forward(weights: Weights, cfg: ModelConfig, tokens: jax.Array, positions: jax.Array,
            attend: Attend, caches: Sequence[Any], *, logits_index: jax.Array | None = None,
            seq_lens_per_token: jax.Array | None = None,
            lora: lora_apply.LoraInputs | None = None,
            aux_layers: tuple[int, ...] = (), moe_fn: Callable[..., jax.Array] | None = None,
            mixer: linear_attention.Mixer | None = None) -> tuple[jax.Array, ...]:
    """tokens, positions: [...] int32. Returns (float32 logits, updated caches), and with
    `aux_layers` a third output: the residual stream entering each of those layers (num_layers:
    leaving the last one), concatenated in layer order ([..., len(aux_layers) * D]: what an
    EAGLE-3 or an MTP head reads).

    logits_index: gather these rows of the flattened token axis before the lm_head, so a step
    computes logits only for the rows that sample ([R] -> logits [R, Vp]); None keeps every row.
    seq_lens_per_token: [...] each token's sequence length (dynamic RoPE only).
    lora: adapter slots and each token's slot one-hot [..., N] (multi-LoRA), or None.
    moe_fn: the sparse blocks' function (moe_mlp's signature): expert_parallel.make_moe's explicit
    dispatch for an expert-parallel layout; None: moe.moe_mlp, partitioned by XLA.
    mixer: what carries the linear-attention layers' states (a hybrid stack only).
    """
    x = jnp.take(weights.embed, tokens, axis=0)
    if cfg.embed_scale is not None:
        x = x * jnp.asarray(cfg.embed_scale, x.dtype)
    rotary = rotary_tables(cfg, positions, seq_lens_per_token)
    new_caches, aux = [], []
    for i, layer in enumerate(weights.layers):
        if i in aux_layers:
            aux.append(x)
        lo = None if lora is None else (lora.layers[i], lora.one_hot)
        x, cache = decoder_layer(cfg, i, layer, x, rotary, attend, caches[i], lo, moe_fn, mixer)
        new_caches.append(cache)
    if cfg.num_layers in aux_layers:  # the residual stream after the last layer (an MTP head reads it)
        aux.append(x)
    if logits_index is not None:
        x = jnp.take(x.reshape(-1, x.shape[-1]), logits_index, axis=0)
    x = norm(cfg, x, weights.final_norm)
    logits = soft_cap(lm_head(weights, x), cfg.final_soft_cap)
    if aux_layers:
        return logits, new_caches, jnp.concatenate(aux, axis=-1)
    return logits, new_caches
