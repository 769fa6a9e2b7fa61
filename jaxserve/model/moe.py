"""A sparse mixture-of-experts MLP block (Qwen3-MoE, Mixtral) as a pure function.

Routing follows the Hugging Face models: router logits in the model dtype, softmax in float32 over
all experts, the top-k, renormalised to sum to one where the config says so. Each token's k
(token, expert) pairs are sorted by expert so that every expert's tokens are contiguous, and the
three expert projections run as grouped matmuls over those groups (`grouped_matmul`: tokamax's
ragged_dot, whose XLA implementation is `jax.lax.ragged_dot`; Mosaic/Triton kernels on TPU/GPU).
The outputs return to (token, slot) order and are summed with the routing weights.
"""

from __future__ import annotations

import contextlib
from typing import Any

import jax
import jax.numpy as jnp

from jaxserve.config import MoEConfig
from jaxserve.model.matmul import einsum
from jaxserve.model.weights import LayerWeights


def _tokamax():
    """tokamax, imported once absl's flags count as parsed: tokamax reads its options through absl
    flags and would otherwise parse this process's own command line as absl flags (and reject it)."""
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
    import tokamax

    return tokamax


def compile_scope(mesh: Any) -> contextlib.AbstractContextManager:
    """Where programs are lowered for GPUs this process does not have (compile-only targets):
    tokamax picks its kernels by the default device, so tell it to cross-compile; else nothing."""
    if mesh.devices.flat[0].platform == "gpu" and jax.default_backend() != "gpu":
        return _tokamax().config.cross_compile(True)
    return contextlib.nullcontext()


def grouped_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """lhs [M, K] rows grouped contiguously by group_sizes [G]; rhs [G, K, N] -> [M, N]. 16-bit
    operands multiply at the default precision whatever jax_default_matmul_precision says (their
    products are exact in the float32 accumulator; Mosaic rejects a float32 contract for them)."""
    precision = jax.lax.Precision.DEFAULT if lhs.dtype.itemsize == 2 else None
    return _tokamax().ragged_dot(lhs, rhs, group_sizes, precision=precision, preferred_element_type=lhs.dtype)


def route(layer: LayerWeights, x: jax.Array, moe: MoEConfig) -> tuple[jax.Array, jax.Array]:
    """x [T, D] -> (weights [T, k] float32, expert ids [T, k] int32)."""
    logits = einsum("td,de->te", x, layer.router)
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, moe.top_k)
    if moe.renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


def moe_mlp(layer: LayerWeights, x: jax.Array, moe: MoEConfig) -> jax.Array:
    """x [..., D] -> [..., D]: the experts' SwiGLU MLPs, mixed by the router's weights."""
    shape = x.shape
    x = x.reshape(-1, shape[-1])                                                   # [T, D]
    weights, experts = route(layer, x, moe)
    flat = experts.reshape(-1)                                                     # [T k]
    order = jnp.argsort(flat, stable=True)
    rows = jnp.take(x, order // moe.top_k, axis=0)                                 # [T k, D] by expert
    sizes = jnp.bincount(flat, length=moe.num_experts).astype(jnp.int32)           # [E]
    gate = grouped_matmul(rows, layer.we_gate, sizes)
    up = grouped_matmul(rows, layer.we_up, sizes)
    out = grouped_matmul(jax.nn.silu(gate) * up, layer.we_down, sizes)            # [T k, D]
    out = jnp.zeros_like(out).at[order].set(out).reshape(x.shape[0], moe.top_k, -1)  # (token, slot) order
    mixed = jnp.einsum("tkd,tk->td", out.astype(jnp.float32), weights)
    return mixed.astype(x.dtype).reshape(shape)
