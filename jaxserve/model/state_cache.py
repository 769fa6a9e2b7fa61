"""The recurrent-state cache beside the KV pages: one slot per running sequence, per linear layer a
conv window and a delta-rule state (model/linear_attention.py).

Slots are handed out by the host (engine/page_allocator.py: taken when a sequence opens, returned
when it is freed) and reach the step as `StepArrays.state_slot` ([S], padding = the slot count:
reads give zeros, writes are dropped). A sequence whose chunk starts at position 0 starts from a
zero state whatever its slot held; a forked sample's slot is first filled from its parent's
(`copy_states`). The states ride in the KV pool's pytree (KVPages.states), so they are donated
into every step with the pages.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxserve.core.config import ModelConfig
from jaxserve.parallel import sharding

STATE_DTYPE = jnp.float32  # the delta rule accumulates in float32: its state stays so


class LinearState(NamedTuple):
    """One linear layer's slots: conv [N, K-1, C] in the compute dtype (the last K-1 conv inputs),
    delta [N, Hv, Dk, Dv] float32."""
    conv: jax.Array
    delta: jax.Array


def abstract(cfg: ModelConfig, num_slots: int, dtype: Any, placement: sharding.Placement) -> list[LinearState]:
    """Per linear layer its slots' ShapeDtypeStructs, replicated over the mesh (empty for a model
    without linear layers)."""
    if cfg.linear is None:
        return []
    lin = cfg.linear
    where = sharding.replicated(placement.mesh)
    conv = jax.ShapeDtypeStruct((num_slots, lin.conv_kernel - 1, lin.conv_dim), jnp.dtype(dtype), sharding=where)
    delta = jax.ShapeDtypeStruct((num_slots, lin.num_v_heads, lin.k_head_dim, lin.v_head_dim), STATE_DTYPE,
                                 sharding=where)
    return [LinearState(conv, delta) for _ in cfg.linear_layers]


def copy_states(states: list[LinearState], src: jax.Array, dst: jax.Array) -> list[LinearState]:
    """Slot dst[i] becomes a copy of slot src[i]; an out-of-bounds dst (padding) copies nothing."""
    def one(slots: jax.Array) -> jax.Array:
        return slots.at[dst].set(jnp.take(slots, src, axis=0, mode="clip"), mode="drop")
    return jax.tree.map(one, states)
