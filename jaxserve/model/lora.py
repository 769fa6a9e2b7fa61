"""The LoRA product of a batch with mixed adapters, inside the forward (jnp).

Each token row carries a one-hot of its slot over the N slots (all zeros: the base model). For a
projection with slot factors a [*in, N, R] and b [N, R, *out]:
    delta = ((x @ a) * one_hot) @ b          x [..., *in] -> [..., N, R] -> [..., *out]
Every token multiplies by every slot's A (N R columns, small next to the projection itself) and the
mask keeps its own; no gather of per-token factors, so the cost and the shapes do not depend on
which adapters the batch mixes.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

# module -> (x subscripts, a subscripts, b subscripts, output subscripts)
_SUBSCRIPTS = {
    "q_proj": ("d", "dnr", "nrhk", "hk"), "k_proj": ("d", "dnr", "nrhk", "hk"), "v_proj": ("d", "dnr", "nrhk", "hk"),
    "o_proj": ("hk", "hknr", "nrd", "d"),
    "gate_proj": ("d", "dnr", "nrf", "f"), "up_proj": ("d", "dnr", "nrf", "f"), "down_proj": ("f", "fnr", "nrd", "d"),
}


class LoraInputs(NamedTuple):
    layers: list[dict[str, tuple[jax.Array, jax.Array]]]   # per layer: module -> (a, b)
    one_hot: jax.Array                                     # [..., N] float: each token's slot


def delta(module: str, x: jax.Array, factors: tuple[jax.Array, jax.Array], one_hot: jax.Array) -> jax.Array:
    """The adapters' update of `module`'s output for input x (token dims leading, as one_hot's)."""
    xs, as_, bs, os = _SUBSCRIPTS[module]
    a, b = factors
    xa = jnp.einsum(f"...{xs},{as_}->...nr", x.astype(jnp.float32), a.astype(jnp.float32))
    out = jnp.einsum(f"...nr,{bs}->...{os}", xa * one_hot[..., None].astype(jnp.float32), b.astype(jnp.float32))
    return out.astype(x.dtype)


def add(y: jax.Array, module: str, x: jax.Array, lora: tuple[dict, jax.Array] | None) -> jax.Array:
    """y + the adapters' update when `lora` (this layer's factors, one_hot) adapts `module`; a batch
    in which no token uses an adapter skips the products (under `lax.cond`)."""
    if lora is None or module not in lora[0]:
        return y
    factors, one_hot = lora
    return jax.lax.cond(jnp.any(one_hot > 0), lambda: y + delta(module, x, factors[module], one_hot), lambda: y)
