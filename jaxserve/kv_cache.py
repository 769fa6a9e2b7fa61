"""The device-side KV page pool: shapes, shardings, the write of new K/V into slots, page copies.

Per layer one K and one V array of shape [num_pages, page_size, num_kv_heads, head_dim], split over
KV heads on the model axis (the runner duplicates KV heads up to a wider axis, model/kv_heads.py;
replicated when the axis does not divide them). A token's
slot is `page * page_size + offset`. Padding tokens carry the out-of-bounds slot
`num_pages * page_size` and every write uses `mode="drop"`, so padding never touches a real page.
Pages are allocated and freed on the host (page_allocator.py); this file never decides which.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import Mesh, NamedSharding

from jaxserve import sharding
from jaxserve.config import ModelConfig
from jaxserve.model.weights import logical_dims

KV_AXES = ("pages", "page_slots", "kv_heads", "head_dim")


@struct.dataclass
class KVPages:
    k: list[jax.Array]  # per layer [num_pages, page_size, num_kv_heads, head_dim]
    v: list[jax.Array]

    @property
    def num_pages(self) -> int:
        return self.k[0].shape[0]

    @property
    def page_size(self) -> int:
        return self.k[0].shape[1]


def kv_sharding(cfg: ModelConfig, mesh: Mesh, rules: sharding.Rules = sharding.DEFAULT_RULES) -> NamedSharding:
    rules = sharding.rules_for(logical_dims(cfg), mesh, rules)
    return sharding.named(mesh, *KV_AXES, rules=rules)


def allocate(cfg: ModelConfig, num_pages: int, page_size: int, dtype: Any, mesh: Mesh) -> KVPages:
    shape = (num_pages, page_size, cfg.num_kv_heads, cfg.head_dim)
    zeros = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=kv_sharding(cfg, mesh))
    return KVPages(k=[zeros() for _ in range(cfg.num_layers)], v=[zeros() for _ in range(cfg.num_layers)])


def write(k_pages: jax.Array, v_pages: jax.Array, k: jax.Array, v: jax.Array, slot_mapping: jax.Array
          ) -> tuple[jax.Array, jax.Array]:
    """k, v: [T, Hkv, hd] new entries; slot_mapping: [T] int32 (out of bounds = padding, dropped)."""
    p, ps, h, d = k_pages.shape
    k_flat = k_pages.reshape(p * ps, h, d).at[slot_mapping].set(k.astype(k_pages.dtype), mode="drop")
    v_flat = v_pages.reshape(p * ps, h, d).at[slot_mapping].set(v.astype(v_pages.dtype), mode="drop")
    return k_flat.reshape(p, ps, h, d), v_flat.reshape(p, ps, h, d)


def copy_pages(kv: KVPages, src: jax.Array, dst: jax.Array) -> KVPages:
    """Copy-on-write: page dst[i] becomes a copy of page src[i]. src, dst: [C] int32; an
    out-of-bounds dst (padding) copies nothing."""
    def one(pages: jax.Array) -> jax.Array:
        return pages.at[dst].set(jnp.take(pages, src, axis=0, mode="clip"), mode="drop")
    return KVPages(k=[one(a) for a in kv.k], v=[one(a) for a in kv.v])
