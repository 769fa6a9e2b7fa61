"""Expert parallelism with explicit token dispatch and combine: each device of the expert axis
holds E/ep whole experts, and tokens travel to their experts' device and back by all-to-all.

Inside `shard_map` over the mesh (x arrives replicated, as the attention block leaves it):
  1. each device of the expert axis takes its 1/ep slice of the tokens and routes it (top-k);
  2. its (token, slot) rows, sorted by expert, fill a [ep, C, D] send buffer (row block d for the
     device owning those experts; C = t*k, room for every row to go to one device: nothing drops);
  3. all_to_all over the expert axis: device d receives the rows every device sent it;
  4. it runs its local experts over them as grouped matmuls (rows sorted by local expert; padding
     rows sort last and belong to no group); with a tensor axis inside the experts (EP x TP) each
     device holds a 1/tp column slice of every local expert, and the down projection's partial
     sums meet in a psum over that axis;
  5. all_to_all back, each row to the slot it came from; the k outputs mix by the routing weights;
  6. all_gather over the expert axis: every device has every token again.
Routing, sorting and the grouped matmuls are moe.py's, so the numbers are those of `moe_mlp`.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxserve.parallel import sharding
from jaxserve.core.config import ModelConfig
from jaxserve.core.layer_kinds import MoEConfig
from jaxserve.model.moe import ExpertStack, expert_stack, experts_forward, grouped_matmul, moe_mlp, route, shared_expert
from jaxserve.model.weights import LayerWeights, logical_dims

MoEFn = Callable[[LayerWeights, jax.Array, MoEConfig], jax.Array]


@functools.lru_cache(maxsize=None)  # one function per (model, placement): a stable jit static argument
def make_moe(cfg: ModelConfig, placement: sharding.Placement) -> MoEFn | None:
    """The sparse blocks' function for a layout: explicit all-to-all dispatch when the rules put
    whole experts on a mesh axis of more than one device (layouts "tp-ep", "tp-ep-data"); None
    (moe.moe_mlp, partitioned by XLA) otherwise, e.g. tensor parallelism inside every expert."""
    if cfg.moe is None:
        return None
    mesh, rules = placement
    resolved = sharding.rules_for(logical_dims(cfg), mesh, rules)
    expert_axis = resolved.get("expert")  # (rules_for drops axes of one device)
    if expert_axis is not None:
        return make_expert_parallel(mesh, expert_axis, resolved.get("expert_mlp"))
    width_axis = resolved.get("expert_mlp")
    return None if width_axis is None else make_tensor_parallel(mesh, width_axis)


def make_tensor_parallel(mesh: Mesh, axis: str) -> MoEFn:
    """The sparse blocks' function when every expert's width is split over `axis` (layout "tp"):
    routing and sorting as moe_mlp does them on every device, then the grouped matmuls run per
    device on its share of the width (gate / up column-parallel, down row-parallel) and the partial
    outputs are summed over `axis`. Explicit because tokamax's Mosaic ragged-dot kernel cannot be
    partitioned by XLA: left to it, a v6e-8 could not compile Qwen3-30B-A3B at 8192-token steps."""
    width, whole = P(None, None, axis), P()

    def per_device(stack: ExpertStack, moe: MoEConfig, rows: jax.Array, sizes: jax.Array,
                   expert: jax.Array) -> jax.Array:
        specs = ExpertStack(gate=width, up=width, down=P(None, axis, None),
                            b_gate=None if stack.b_gate is None else P(None, axis),
                            b_up=None if stack.b_up is None else P(None, axis))
        return jax.shard_map(
            lambda stack, rows, sizes, expert: jax.lax.psum(experts_forward(stack, moe, rows, sizes, expert), axis),
            mesh=mesh, in_specs=(specs, whole, whole, whole), out_specs=whole, check_vma=False,
        )(stack, rows, sizes, expert)

    block = functools.partial(moe_mlp, experts_fn=per_device)
    block.__name__ = f"tensor_parallel_experts_{axis}"
    return block


def make_expert_parallel(mesh: Mesh, expert_axis: str, tensor_axis: str | None = None) -> MoEFn:
    """An MoE block function (moe_mlp's signature) whose experts are split over `expert_axis`
    (we_* [E, D, F] sharded on E) and, optionally, whose expert width is split over `tensor_axis`."""
    ep = mesh.shape[expert_axis]

    def block(layer: LayerWeights, x: jax.Array, moe: MoEConfig) -> jax.Array:
        if moe.expert_biases or moe.router_bias or moe.activation != "silu":
            raise ValueError("expert parallelism (--layout tp-ep*) does not serve biased experts or the clamped "
                             "SwiGLU (gpt-oss) yet; serve it with --layout tp")
        if moe.num_experts % ep:
            raise ValueError(f"{moe.num_experts} experts do not split over a {ep}-way expert axis")
        shape = x.shape
        x = x.reshape(-1, shape[-1])                                            # [T, D]
        pad = -x.shape[0] % ep
        if pad:
            x = jnp.pad(x, ((0, pad), (0, 0)))
        col, row = P(expert_axis, None, tensor_axis), P(expert_axis, tensor_axis, None)
        bias = layer.choice_bias if layer.choice_bias is not None else jnp.zeros(moe.num_experts, jnp.float32)
        stack = expert_stack(layer, x.dtype)  # quantized experts widened to the compute dtype
        out = jax.shard_map(
            lambda x, router, bias, gate, up, down: _dispatch_compute_combine(x, router, bias, gate, up, down, moe, ep,
                                                                              expert_axis, tensor_axis),
            mesh=mesh, in_specs=(P(), P(), P(), col, col, row), out_specs=P(), check_vma=False,
        )(x, layer.router, bias, stack.gate, stack.up, stack.down)
        out = out[: out.shape[0] - pad]
        return (out + shared_expert(layer, x[: out.shape[0]])).reshape(shape)

    block.__name__ = f"expert_parallel_{expert_axis}" + (f"_x_{tensor_axis}" if tensor_axis else "")
    return block


def _dispatch_compute_combine(x: jax.Array, router: jax.Array, bias: jax.Array, we_gate: jax.Array, we_up: jax.Array,
                              we_down: jax.Array, moe: MoEConfig, ep: int, expert_axis: str,
                              tensor_axis: str | None) -> jax.Array:
    """One device's part. x [T, D] (all tokens); we_gate/we_up [E/ep, D, F/tp], we_down [E/ep, F/tp, D]."""
    k, local = moe.top_k, moe.num_experts // ep
    t = x.shape[0] // ep
    me = jax.lax.axis_index(expert_axis)
    mine = jax.lax.dynamic_slice_in_dim(x, me * t, t)                          # [t, D]
    weights, experts = route(router, mine, moe, bias)                           # [t, k]
    flat = experts.reshape(-1)                                                  # [t k]
    order = jnp.argsort(flat, stable=True)
    expert = flat[order]                                                        # sorted expert ids
    dest = expert // local                                                      # their devices
    counts = jnp.bincount(dest, length=ep)
    starts = jnp.cumsum(counts) - counts
    slot = jnp.arange(t * k) - starts[dest]                                     # place in dest's block
    rows = jnp.take(mine, order // k, axis=0)                                   # [t k, D]
    c = t * k
    send = jnp.zeros((ep, c, x.shape[1]), x.dtype).at[dest, slot].set(rows)
    send_ids = jnp.full((ep, c), local, jnp.int32).at[dest, slot].set(expert % local)  # local: padding
    recv = jax.lax.all_to_all(send, expert_axis, 0, 0, tiled=False)             # [ep, c, D] from each source
    recv_ids = jax.lax.all_to_all(send_ids, expert_axis, 0, 0, tiled=False)     # [ep, c]

    ids = recv_ids.reshape(-1)
    by_expert = jnp.argsort(ids, stable=True)                                   # padding (id = local) last
    sizes = jnp.bincount(ids, length=local + 1)[:local].astype(jnp.int32)
    h = jnp.take(recv.reshape(-1, x.shape[1]), by_expert, axis=0)
    gate = grouped_matmul(h, we_gate, sizes)
    up = grouped_matmul(h, we_up, sizes)
    y = grouped_matmul(jax.nn.silu(gate) * up, we_down, sizes)                  # [ep c, D] (partial over tp)
    if tensor_axis is not None:
        y = jax.lax.psum(y, tensor_axis)
    y = jnp.zeros_like(y).at[by_expert].set(y).reshape(ep, c, -1)               # back to arrival order
    back = jax.lax.all_to_all(y, expert_axis, 0, 0, tiled=False)                # [ep, c, D] per dest
    done = back[dest, slot]                                                     # [t k, D], sorted order
    out = jnp.zeros_like(done).at[order].set(done).reshape(t, k, -1)            # (token, slot) order
    mixed = jnp.einsum("tkd,tk->td", out.astype(jnp.float32), weights).astype(x.dtype)
    return jax.lax.all_gather(mixed, expert_axis, axis=0, tiled=True)           # [T, D]

