"""A sparse mixture-of-experts MLP block (Qwen3-MoE, Mixtral, GLM-4.5, MiniMax-M2) as a pure function.

Routing follows the Hugging Face models: softmax in float32 over the router's logits (computed in
the model dtype), or sigmoid scores of float32 logits whose choice adds a per-expert bias, first
keeping the best groups of experts (`route`); the top-k, renormalised to sum to one where the config
says so and scaled by the routed scaling factor. A shared expert adds a dense MLP. Each token's k
(token, expert) pairs are sorted by expert so that every expert's tokens are contiguous, and the
three expert projections run as grouped matmuls over those groups (`grouped_matmul`: tokamax's
Mosaic / Triton ragged_dot kernels on TPU / GPU; on a CPU `jax.lax.ragged_dot`, or at decode sizes a
loop over the experts that have tokens).
The outputs return to (token, slot) order and are summed with the routing weights.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
from flax import struct

from jaxserve.core.layer_kinds import MoEConfig
from jaxserve.model.matmul import dense, einsum
from jaxserve.model.weights import LayerWeights
from jaxserve.quant.mxfp4 import as_dense


def _tokamax():
    """tokamax, imported once absl's flags count as parsed: tokamax reads its options through absl
    flags and would otherwise parse this process's own command line as absl flags (and reject it)."""
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
    import tokamax

    return tokamax


# The platform programs are being lowered for, when it is not this process's default backend
# (compile-only TPU/GPU targets: compile_scope).
_TARGET_PLATFORM: contextvars.ContextVar[str | None] = contextvars.ContextVar("moe_target_platform", default=None)


@contextlib.contextmanager
def compile_scope(mesh: Any) -> Iterator[None]:
    """Lowering for `mesh`'s devices: the grouped matmuls take that platform's kernels, and for
    GPUs this process does not have tokamax is told to cross-compile (it picks kernels by the
    default device, the CPU here)."""
    platform = mesh.devices.flat[0].platform
    token = _TARGET_PLATFORM.set(platform)
    try:
        if platform == "gpu" and jax.default_backend() != "gpu":
            with _tokamax().config.cross_compile(True):
                yield
        else:
            yield
    finally:
        _TARGET_PLATFORM.reset(token)


# tokamax's implementation on a GPU: its Triton kernel under the jax it is built for (0.10; tests/
# test_target_compile.py compiles it for H100s), XLA's ragged_dot under jax 0.11, where neither of
# tokamax 0.0.12's GPU kernels lowers (Mosaic GPU: a TypeError in its mesh; Triton: pl.dot is gone)
# and the tokamax releases for jax 0.11 import xprof and its dependencies (~40 MB: not carried to
# the device machine, docs/BENCHMARKS.md "Device check"). Not tokamax's own first choice on NVIDIA
# (Mosaic GPU) under jax 0.10 either: its failure there is a TypeError too, which tokamax does not
# take as "try the next one".
GPU_IMPLEMENTATIONS = ("triton",) if jax.__version_info__ < (0, 11) else ("xla",)
# Up to this many rows (decode-sized steps), the CPU multiplies only the groups that have rows.
SKIP_EMPTY_MAX_ROWS = 64


def grouped_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """lhs [M, K] rows grouped contiguously by group_sizes [G]; rhs [G, K, N] -> [M, N].

    On TPU and GPU: tokamax's ragged_dot kernels (Mosaic TPU, Triton), which skip empty groups; 16-bit
    operands multiply at the default precision whatever jax_default_matmul_precision says (their
    products are exact in the float32 accumulator; Mosaic rejects a float32 contract for them).
    On a CPU tokamax would run XLA's `jax.lax.ragged_dot`, which reads every group's weights:
    at decode sizes (2 of 8 experts used at batch 1) that is several times the work, so up to
    SKIP_EMPTY_MAX_ROWS rows a loop multiplies only the groups with rows; larger M (prefill) takes
    `jax.lax.ragged_dot` directly (tokamax is not imported in a CPU process)."""
    platform = _TARGET_PLATFORM.get() or jax.default_backend()
    if platform == "cpu":
        if lhs.shape[0] <= SKIP_EMPTY_MAX_ROWS:
            return _nonempty_groups(lhs, rhs, group_sizes)
        return jax.lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=lhs.dtype)
    precision = jax.lax.Precision.DEFAULT if lhs.dtype.itemsize == 2 else None
    return _tokamax().ragged_dot(lhs, rhs, group_sizes, precision=precision, preferred_element_type=lhs.dtype,
                                 implementation=GPU_IMPLEMENTATIONS if platform == "gpu" else None)


def _nonempty_groups(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """grouped_matmul by a loop over the groups that multiplies (and reads the weights of) only
    those with rows: each product covers all M rows, masked to the group's own."""
    ends = jnp.cumsum(group_sizes)
    row = jnp.arange(lhs.shape[0])

    def group(g: jax.Array, out: jax.Array) -> jax.Array:
        def multiply(out: jax.Array) -> jax.Array:
            mine = (row >= ends[g] - group_sizes[g]) & (row < ends[g])
            product = jnp.dot(lhs, rhs[g], preferred_element_type=jnp.float32).astype(out.dtype)
            return out + jnp.where(mine[:, None], product, jnp.zeros((), out.dtype))
        return jax.lax.cond(group_sizes[g] > 0, multiply, lambda out: out, out)

    return jax.lax.fori_loop(0, rhs.shape[0], group, jnp.zeros((lhs.shape[0], rhs.shape[2]), lhs.dtype))


def route(router: jax.Array, x: jax.Array, moe: MoEConfig, bias: jax.Array | None = None,
          router_bias: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """x [T, D], router [D, E], bias [E] float32 (sigmoid scoring's choice bias), router_bias [E]
    (the logits' own bias: gpt-oss) -> (weights [T, k] float32, expert ids [T, k] int32)."""
    if moe.scoring == "softmax":
        logits = einsum("td,de->te", x, router)
        if router_bias is not None:
            logits = logits + router_bias
        probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
        weights, experts = jax.lax.top_k(probs, moe.top_k)
    else:
        scores = jax.nn.sigmoid(jnp.dot(x.astype(jnp.float32), router.astype(jnp.float32)))      # [T, E]
        choice = scores if bias is None else scores + bias
        if moe.topk_group < moe.n_group:  # keep the groups whose best two biased scores sum highest
            grouped = choice.reshape(choice.shape[0], moe.n_group, -1)                        # [T, G, E/G]
            _, keep = jax.lax.top_k(jax.lax.top_k(grouped, 2)[0].sum(-1), moe.topk_group)     # [T, topk_group]
            kept = jnp.zeros(grouped.shape[:2], bool).at[jnp.arange(grouped.shape[0])[:, None], keep].set(True)
            choice = jnp.where(kept[..., None], grouped, -jnp.inf).reshape(choice.shape)
        _, experts = jax.lax.top_k(choice, moe.top_k)
        weights = jnp.take_along_axis(scores, experts, axis=-1)
    if moe.renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights * moe.routed_scale, experts.astype(jnp.int32)


def shared_expert(layer: LayerWeights, x: jax.Array) -> jax.Array | float:
    """The shared expert's SwiGLU MLP on x [..., D] (0 where the model has none)."""
    if layer.ws_gate is None:
        return 0.0
    h = jax.nn.silu(einsum("...d,df->...f", x, layer.ws_gate)) * einsum("...d,df->...f", x, layer.ws_up)
    out = einsum("...f,fd->...d", h, layer.ws_down)
    if layer.shared_gate is not None:  # Qwen3-Next: a per-token sigmoid gate on the shared expert
        out = jax.nn.sigmoid(jnp.einsum("...d,d->...", x, layer.shared_gate))[..., None] * out
    return out


def expert_activation(moe: MoEConfig, gate: jax.Array, up: jax.Array) -> jax.Array:
    """The experts' gated activation of gate, up [..., Fe]."""
    if moe.activation == "silu":
        return jax.nn.silu(gate) * up
    gate = jnp.minimum(gate, moe.swiglu_limit)  # clamped SwiGLU (gpt-oss)
    up = jnp.clip(up, -moe.swiglu_limit, moe.swiglu_limit)
    return gate * jax.nn.sigmoid(gate * moe.swiglu_alpha) * (up + 1)


def _biased(out: jax.Array, bias: jax.Array | None, expert: jax.Array) -> jax.Array:
    """out [M, N] rows of the experts `expert` [M], plus each one's bias [E, N] (none: out)."""
    return out if bias is None else out + jnp.take(bias, expert, axis=0).astype(out.dtype)


@struct.dataclass
class ExpertStack:
    """The experts' projections as the grouped matmuls read them (input features first, in the
    compute dtype) and their biases (None where the model has none)."""
    gate: jax.Array             # [E, D, Fe]
    up: jax.Array               # [E, D, Fe]
    down: jax.Array             # [E, Fe, D]
    b_gate: jax.Array | None    # [E, Fe]
    b_up: jax.Array | None      # [E, Fe]


def expert_stack(layer: LayerWeights, dtype: Any) -> ExpertStack:
    """A layer's experts; packed MXFP4 and quantized (fp8 blocks, int8, int4) ones become the compute
    dtype here, inside the step."""
    return ExpertStack(*(dense(as_dense(w, dtype), dtype) for w in (layer.we_gate, layer.we_up, layer.we_down)),
                       layer.be_gate, layer.be_up)


def experts_forward(stack: ExpertStack, moe: MoEConfig, rows: jax.Array, sizes: jax.Array,
                    expert: jax.Array) -> jax.Array:
    """rows [M, D] sorted by their experts `expert` [M] (sizes [E] rows each) -> [M, D]: each row
    through its expert's gated MLP (without the down projection's bias)."""
    gate = _biased(grouped_matmul(rows, stack.gate, sizes), stack.b_gate, expert)
    up = _biased(grouped_matmul(rows, stack.up, sizes), stack.b_up, expert)
    return grouped_matmul(expert_activation(moe, gate, up), stack.down, sizes)


ExpertsFn = Callable[[ExpertStack, MoEConfig, jax.Array, jax.Array, jax.Array], jax.Array]


def moe_mlp(layer: LayerWeights, x: jax.Array, moe: MoEConfig, experts_fn: ExpertsFn = experts_forward) -> jax.Array:
    """x [..., D] -> [..., D]: the experts' gated MLPs, mixed by the router's weights, plus the
    shared expert. experts_fn: experts_forward's signature (expert_parallel.make_tensor_parallel
    runs it per device over the experts' split width)."""
    shape = x.shape
    x = x.reshape(-1, shape[-1])                                                   # [T, D]
    weights, experts = route(layer.router, x, moe, layer.choice_bias, layer.router_bias)
    flat = experts.reshape(-1)                                                     # [T k]
    order = jnp.argsort(flat, stable=True)
    expert = flat[order]                                                           # [T k] each row's expert
    rows = jnp.take(x, order // moe.top_k, axis=0)                                 # [T k, D] by expert
    sizes = jnp.bincount(flat, length=moe.num_experts).astype(jnp.int32)           # [E]
    out = _biased(experts_fn(expert_stack(layer, x.dtype), moe, rows, sizes, expert), layer.be_down, expert)
    out = jnp.zeros_like(out).at[order].set(out).reshape(x.shape[0], moe.top_k, -1)  # (token, slot) order
    mixed = jnp.einsum("tkd,tk->td", out.astype(jnp.float32), weights).astype(x.dtype)
    return (mixed + shared_expert(layer, x)).reshape(shape)
