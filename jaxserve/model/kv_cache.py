"""The device-side KV page pool: shapes, shardings, the write of new K/V into slots, page copies.

One K and one V array of shape [num_pages, page_size, num_kv_heads, head_dim] per layer of a
uniform stack (on a TPU: 64-wide heads as one [..., 128] array of K and V side by side,
kv_groups.fused_kv, and other narrow heads zero-padded to whole 128-lane tiles,
kv_groups.pool_head_dim); a stack that mixes sliding and full layers shares its arrays between its
layer groups (core/kv_groups.py: layer i uses array `kv_groups.layer_array[i]`). Split over
KV heads on the model axis (the runner duplicates KV heads up to a wider axis, model/kv_heads.py;
replicated when the axis does not divide them). Quantized pools (`--kv-cache-dtype`, quant/kv.py)
store 8-bit values and per layer a K and a V scale array [num_pages, num_kv_heads, page_size]
float32 (kernels_pallas/kv_quant.py), quantized here as they are written. A token's
slot is `page * page_size + offset`. Multi-head latent attention (cfg.mla) stores one array per
layer, a latent row [kv_lora_rank + rope] per token as its one KV head, which attention reads as
both K and V (a LayerKV whose k is its v and whose v_scales are its k_scales). A hybrid stack's
linear-attention layers keep no pages: their recurrent states ride beside the pages in `states`
(model/state_cache.py), so they are donated with them. Padding tokens
carry the out-of-bounds slot `num_pages * page_size` and every write uses `mode="drop"`, so
padding never touches a real page.
Pages are allocated and freed on the host (page_allocator.py); this file never decides which.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import NamedSharding

from jaxserve.parallel import sharding
from jaxserve.core.config import ModelConfig
from jaxserve.core.kv_groups import fused_kv, pool_head_dim
from jaxserve.model import state_cache
from jaxserve.model.state_cache import LinearState
from jaxserve.model.weights import logical_dims
from kernels_pallas.kv_quant import SCALE_DTYPE, is_quantized, quantize

KV_AXES = ("pages", "page_slots", "kv_heads", "head_dim")
SCALE_AXES = ("pages", "kv_heads", "page_slots")


class LayerKV(NamedTuple):
    """One layer's pages: k, v [P, ps, KVH, D]; k_scales, v_scales [P, KVH, ps] f32 or None. Fused
    (kv_groups.fused_kv): k and v are the same [P, ps, KVH, 2 hd] array, K in its first hd lanes."""
    k: jax.Array
    v: jax.Array
    k_scales: jax.Array | None = None
    v_scales: jax.Array | None = None

    @property
    def fused(self) -> bool:
        return self.v is self.k


@struct.dataclass
class KVPages:
    k: list[jax.Array]  # per pool array [num_pages, page_size, num_kv_heads, head_dim]
    v: list[jax.Array]  # empty when k holds K and V side by side (kv_groups.fused_kv)
    k_scales: list[jax.Array] | None = None  # per pool array [num_pages, num_kv_heads, page_size] (quantized)
    v_scales: list[jax.Array] | None = None
    # per linear-attention layer its state slots (model/state_cache.py); empty without such layers
    states: list[LinearState] = dataclasses.field(default_factory=list)

    @property
    def num_pages(self) -> int:
        return self.k[0].shape[0]

    @property
    def page_size(self) -> int:
        return self.k[0].shape[1]

    def layers(self) -> list[LayerKV]:
        v = self.v or self.k  # fused or latent: one array is both
        if self.k_scales is None:
            return [LayerKV(k, v) for k, v in zip(self.k, v)]
        return [LayerKV(*parts) for parts in zip(self.k, v, self.k_scales, self.v_scales or self.k_scales)]

    @classmethod
    def from_layers(cls, layers: list[LayerKV]) -> "KVPages":
        first = layers[0]
        quantized = first.k_scales is not None
        return cls(k=[layer.k for layer in layers], v=[] if first.fused else [layer.v for layer in layers],
                   k_scales=[layer.k_scales for layer in layers] if quantized else None,
                   v_scales=([] if first.v_scales is first.k_scales else [layer.v_scales for layer in layers])
                   if quantized else None)


def _sharding(cfg: ModelConfig, placement: sharding.Placement, axes: tuple[str, ...]) -> NamedSharding:
    mesh, rules = placement
    return sharding.named(mesh, *axes, rules=sharding.rules_for(logical_dims(cfg), mesh, rules))


def kv_sharding(cfg: ModelConfig, placement: sharding.Placement) -> NamedSharding:
    return _sharding(cfg, placement, KV_AXES)


def abstract(cfg: ModelConfig, num_pages: int, page_size: int, dtype: Any, placement: sharding.Placement,
             num_state_slots: int = 0, state_dtype: Any = None) -> KVPages:
    """The pool's declaration: ShapeDtypeStructs placed by `placement`; `dtype` is the storage dtype
    (8-bit: with scales). Allocation, the programs' lowering and the memory plans all read it.
    A hybrid stack (cfg.linear) also declares `num_state_slots` recurrent-state slots, their conv
    windows in `state_dtype` (the compute dtype)."""
    if cfg.linear is not None and num_state_slots <= 0:
        raise ValueError("a model with linear-attention layers needs num_state_slots > 0 (one per running sequence)")
    states = state_cache.abstract(cfg, num_state_slots, state_dtype or dtype, placement)
    platform = placement.mesh.devices.flat[0].platform
    fused = cfg.mla is None and fused_kv(cfg.head_dim, platform)
    width = 2 * cfg.head_dim if fused else pool_head_dim(cfg.head_dim, platform, latent=cfg.mla is not None)
    arrays = cfg.kv_groups.num_arrays
    one_array = fused or cfg.mla is not None
    # one object per leaf: a LayerKV whose k is its v is a fused or a latent one
    k, v = ([jax.ShapeDtypeStruct((num_pages, page_size, cfg.num_kv_heads, width), jnp.dtype(dtype),
                                  sharding=kv_sharding(cfg, placement)) for _ in range(n)]
            for n in (arrays, 0 if one_array else arrays))
    if not is_quantized(dtype):
        return KVPages(k=k, v=v, states=states)
    scale = jax.ShapeDtypeStruct((num_pages, cfg.num_kv_heads, page_size), SCALE_DTYPE,
                                 sharding=_sharding(cfg, placement, SCALE_AXES))
    return KVPages(k=k, v=v, k_scales=[scale] * arrays, v_scales=[] if cfg.mla is not None else [scale] * arrays,
                   states=states)


def allocate(cfg: ModelConfig, num_pages: int, page_size: int, dtype: Any, placement: sharding.Placement,
             num_state_slots: int = 0, state_dtype: Any = None) -> KVPages:
    """A zeroed pool (every array its own buffer, so each can be donated)."""
    return sharding.zeros(abstract(cfg, num_pages, page_size, dtype, placement, num_state_slots, state_dtype))


def write(layer: LayerKV, k: jax.Array, v: jax.Array | None, slot_mapping: jax.Array) -> LayerKV:
    """k, v: [T, Hkv, hd] new entries (zero-padded to the pool's head_dim, or put side by side in a
    fused array: kv_groups.fused_kv); v None: k is an MLA latent row, the array's only content;
    slot_mapping: [T] int32 (out of bounds = padding, dropped)."""
    p, ps, h, width = layer.k.shape
    page, offset = slot_mapping // ps, slot_mapping % ps  # padding: page p -> dropped

    def encode(x: jax.Array, scales: jax.Array | None) -> tuple[jax.Array, jax.Array | None]:
        """x as the pages store it, and the scales with its tokens' set (8-bit pages)."""
        if scales is None:
            return x.astype(layer.k.dtype), None
        values, token_scales = quantize(x, layer.k.dtype)                   # [T, Hkv, hd], [T, Hkv]
        return values, scales.at[page, :, offset].set(token_scales, mode="drop")

    def put(pages: jax.Array, values: jax.Array) -> jax.Array:
        return pages.reshape(p * ps, h, width).at[slot_mapping].set(values, mode="drop").reshape(p, ps, h, width)

    k, k_scales = encode(k, layer.k_scales)
    if v is None:
        pages = put(layer.k, pad_lanes(k, width))
        return LayerKV(pages, pages, k_scales, k_scales)
    v, v_scales = encode(v, layer.v_scales)
    if layer.fused:
        pages = put(layer.k, jnp.concatenate([k, v], axis=-1))
        return LayerKV(pages, pages, k_scales, v_scales)
    return LayerKV(put(layer.k, pad_lanes(k, width)), put(layer.v, pad_lanes(v, width)), k_scales, v_scales)


def pad_lanes(x: jax.Array, width: int) -> jax.Array:
    """x [..., hd] zero-padded to [..., width] (a TPU pool's head_dim)."""
    extra = width - x.shape[-1]
    return x if extra == 0 else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, extra)])


def copy_pages(kv: KVPages, src: jax.Array, dst: jax.Array, state_src: jax.Array | None = None,
               state_dst: jax.Array | None = None) -> KVPages:
    """Copy-on-write: page dst[i] becomes a copy of page src[i] (values and scales). src, dst: [C]
    int32; an out-of-bounds dst (padding) copies nothing. A hybrid stack's state slots: slot
    state_dst[j] becomes a copy of state_src[j] (a forked sample takes its parent's state)."""
    def one(pages: jax.Array) -> jax.Array:
        return pages.at[dst].set(jnp.take(pages, src, axis=0, mode="clip"), mode="drop")
    states = kv.states if state_src is None else state_cache.copy_states(kv.states, state_src, state_dst)
    return jax.tree.map(one, kv.replace(states=[])).replace(states=states)


def page_leaves(kv: KVPages) -> list[jax.Array]:
    """The pool's page arrays (values and scales), without a hybrid's state slots."""
    return jax.tree.leaves(kv.replace(states=[]))
