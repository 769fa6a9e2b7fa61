"""Quantized leaves as declarations: a projection's `ParamSpec` -> a qwix `QArray` of `ParamSpec`s.

The values keep the projection's shape and logical axes. The scale (and zero point) has the same
rank with every axis divided by its tile: an output axis is tiled by 1 (one scale per channel)
unless the scheme is block-wise; the contraction axes are tiled whole (per channel), by the group
size, or by the block. A group or block runs over the *flattened* axes in row-major order, as the
checkpoint formats count it over a torch Linear's in/out features: for `wo [Hq, hd, D]` a group of
128 input features with hd = 64 is the tile (2, 64). A scale axis that is not split keeps its
logical name, so it is sharded with its values; an axis of size 1 is replicated.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from jaxserve.model.param_spec import ParamSpec
from jaxserve.quant.scheme import WeightQuant


def flat_tile(dims: Sequence[int], n: int, what: str) -> tuple[int, ...]:
    """Tile of `dims` (row-major) covering n consecutive flattened elements."""
    tile = [1] * len(dims)
    left = n
    for i in reversed(range(len(dims))):
        if left == 1:
            break
        if dims[i] % left == 0:
            tile[i] = left
            left = 1
        elif left % dims[i] == 0:
            tile[i] = dims[i]
            left //= dims[i]
        else:
            break
    if left != 1:
        raise ValueError(f"{what}: a group of {n} does not tile the axes {tuple(dims)}")
    return tuple(tile)


def tile_shape(spec: ParamSpec, q: WeightQuant, name: str) -> tuple[int, ...]:
    """How many consecutive elements of each axis share one scale."""
    contract = spec.contract
    out_axes = [a for a in range(len(spec.shape)) if a not in contract]
    tile = [1] * len(spec.shape)
    k_dims = [spec.shape[a] for a in contract]
    k = math.prod(k_dims)
    if q.per_tensor:
        k_group, out_group = k, math.prod(spec.shape[a] for a in out_axes)
    elif q.block is not None:
        k_group, out_group = q.block
    else:
        k_group, out_group = (q.group_size or k), 1
    k_group = min(k_group, k)  # a contraction shorter than one group is one group
    if k % k_group:
        raise ValueError(f"{name}: {k} input features are not a multiple of the {q.method} group size {k_group}")
    for a, t in zip(contract, flat_tile(k_dims, k_group, name)):
        tile[a] = t
    if out_group > 1:
        o_dims = [spec.shape[a] for a in out_axes]
        o = math.prod(o_dims)
        out_group = min(out_group, o)
        if o % out_group:
            raise ValueError(f"{name}: {o} output features are not a multiple of the {q.method} block {out_group}")
        for a, t in zip(out_axes, flat_tile(o_dims, out_group, name)):
            tile[a] = t
    return tuple(tile)


def declare(spec: ParamSpec, q: WeightQuant, scale_dtype: Any, name: str) -> Any:
    """The `QArray` of `ParamSpec`s that replaces a projection's spec under scheme q."""
    from qwix import QArray  # only quantized models pay for importing qwix

    tile = tile_shape(spec, q, name)
    scale_shape = tuple(s // t for s, t in zip(spec.shape, tile))
    scale_axes = tuple(a if n > 1 else None for a, n in zip(spec.axes, scale_shape))
    values = ParamSpec(spec.shape, q.dtype, spec.axes, "quantized", spec.contract)
    scale = ParamSpec(scale_shape, scale_dtype, scale_axes, "scale")
    zero = ParamSpec(scale_shape, scale_dtype, scale_axes, "zero_point") if q.zero_point else None
    weight = QArray(qvalue=values, scale=scale, zero_point=zero, qtype=q.dtype)
    if q.act_order:
        from jaxserve.quant.act_order import InputPermuted
        inputs = math.prod(spec.shape[a] for a in spec.contract)
        return InputPermuted(weight=weight, perm=ParamSpec((inputs,), np.int32, (None,), "perm"))
    return weight
