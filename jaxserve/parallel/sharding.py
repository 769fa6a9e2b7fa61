"""Mesh construction and the logical-axis -> mesh-axis rules.

Model code and weight declarations name *logical* axes only ("vocab", "q_heads", ...); the rules
below, kept as data, say which mesh axis each one is split over. A rule is dropped for a given
model when the mesh axis does not divide that dimension (e.g. 2 KV heads on an 8-way model axis:
the KV heads are then replicated, which is the standard tensor-parallel answer for GQA).

The mesh uses `AxisType.Auto` on purpose: jitted steps declare their input/output shardings and
XLA's propagation places the collectives; `Explicit` sharding-in-types would make every reshape of
a head axis in the model a typed resharding decision, with no benefit for inference.
"""

from __future__ import annotations

from typing import Any, Mapping, NamedTuple, Sequence

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from jaxserve.quant.scheme import qtype_bits

DATA_AXIS = "data"
MODEL_AXIS = "model"

# logical axis -> mesh axis (None = replicated). The tensor-parallel layout: attention heads, MLP
# columns/rows and the vocabulary are split over `model`; a batch of sequences over `data`.
Rules = Sequence[tuple[str, str | None]]

DEFAULT_RULES: tuple[tuple[str, str | None], ...] = (
    ("batch", DATA_AXIS),
    ("vocab", MODEL_AXIS),
    ("embed", None),
    ("q_heads", MODEL_AXIS),
    ("kv_heads", MODEL_AXIS),
    ("head_dim", None),
    ("mlp", MODEL_AXIS),
    ("expert_mlp", MODEL_AXIS),  # MoE: tensor parallelism inside every expert
    ("expert", None),
    ("tokens", None),
    ("pages", None),
    ("page_slots", None),
)


class Placement(NamedTuple):
    """Where an engine's arrays live: its mesh and its layout's logical-axis rules. The model runner
    holds one; the weights, the KV pool, a proposer's weights and pool and the LoRA slots are all
    placed by it, so every array of a served engine is sharded as `jaxserve plan` counts it."""

    mesh: Mesh
    rules: Rules = DEFAULT_RULES


def make_mesh(data: int = 1, model: int = 1, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A (data, model) mesh over the first data*model devices."""
    devices = list(devices if devices is not None else jax.devices())
    if data < 1 or model < 1:
        raise ValueError(f"mesh axes must be >= 1, got data={data} model={model}")
    if data * model > len(devices):
        raise ValueError(f"mesh {data}x{model} needs {data * model} devices, only {len(devices)} available")
    return jax.make_mesh((data, model), (DATA_AXIS, MODEL_AXIS), axis_types=(AxisType.Auto, AxisType.Auto),
                         devices=devices[: data * model])


def parse_mesh(text: str) -> tuple[int, int]:
    """'2x4' -> (2, 4): data x model."""
    try:
        data, model = (int(p) for p in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"mesh must look like DATAxMODEL (e.g. 1x8), got {text!r}") from None
    if data < 1 or model < 1:
        raise ValueError(f"mesh axes must be >= 1, got {text!r}")
    return data, model


def rules_for(dims: Mapping[str, int], mesh: Mesh,
              rules: Sequence[tuple[str, str | None]] = DEFAULT_RULES) -> dict[str, str | None]:
    """The rules, minus every one whose mesh axis is trivial (size 1) or does not divide that
    logical dimension's size."""
    out: dict[str, str | None] = {}
    for logical, mesh_axis in rules:
        size = dims.get(logical)
        if mesh_axis is not None and (mesh.shape[mesh_axis] == 1 or (size is not None and size % mesh.shape[mesh_axis])):
            mesh_axis = None
        out[logical] = mesh_axis
    return out


def spec(*logical_names: str | None, rules: Mapping[str, str | None],
         shape: Sequence[int] | None = None, mesh: Mesh | None = None) -> PartitionSpec:
    """PartitionSpec for an array whose axes carry these logical names (None = never split).

    With `shape` and `mesh`, an axis the mesh axis does not divide stays whole (a quantized
    weight's scale has fewer groups than its values have rows)."""
    used: set[str] = set()
    axes = []
    for i, name in enumerate(logical_names):
        axis = rules.get(name) if name is not None else None
        if axis is not None and shape is not None and mesh is not None and shape[i] % mesh.shape[axis]:
            axis = None
        if axis is not None and axis in used:  # one mesh axis can split only one array axis
            axis = None
        if axis is not None:
            used.add(axis)
        axes.append(axis)
    return PartitionSpec(*axes)


def named(mesh: Mesh, *logical_names: str | None, rules: Mapping[str, str | None],
          shape: Sequence[int] | None = None) -> NamedSharding:
    return NamedSharding(mesh, spec(*logical_names, rules=rules, shape=shape, mesh=mesh))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def put(tree: Any, shardings: Any) -> Any:
    """jax.device_put of host arrays that every process holds alike (weights read from the same
    checkpoint, a step's inputs). Across processes (multi-host) each places only its own devices'
    slices: device_put would first all-gather every value to check that the processes agree, a
    collective per call. `shardings`: one sharding for every leaf, or a matching tree of them."""
    if jax.process_count() == 1:
        return jax.device_put(tree, shardings)
    if isinstance(shardings, jax.sharding.Sharding):
        shardings = jax.tree.map(lambda _: shardings, tree)

    def place(x: Any, s: jax.sharding.Sharding) -> jax.Array:
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, s, lambda index: x[index])

    return jax.tree.map(place, tree, shardings)


def bytes_per_device(tree: Any) -> int:
    """Bytes one device holds of a declared pytree (ShapeDtypeStructs with shardings): each leaf's
    shard on the first device, where any leaf's shard is largest (shards of uneven splits do not
    occur: an axis the mesh does not divide stays whole). Sub-byte dtypes pack (int4: two a byte)."""
    return sum(math.prod(leaf.sharding.shard_shape(leaf.shape)) * qtype_bits(leaf.dtype) // 8
               for leaf in jax.tree.leaves(tree))


def zeros(tree: Any) -> Any:
    """Zeroed device arrays for a declared pytree (ShapeDtypeStructs with shardings), each its own
    buffer (so each can be donated), made on the devices: nothing is copied from the host."""
    return jax.tree.map(lambda leaf: _zeros_program(leaf.shape, jnp.dtype(leaf.dtype), leaf.sharding)(), tree)


@functools.lru_cache(maxsize=64)
def _zeros_program(shape: tuple[int, ...], dtype: Any, placement: NamedSharding) -> Any:
    """A program making one zeroed array placed by `placement` (leaves of one shape share it: a
    program per layer was a trace and a compile per layer at every start)."""
    return jax.jit(functools.partial(jnp.zeros, shape, dtype), out_shardings=placement)
