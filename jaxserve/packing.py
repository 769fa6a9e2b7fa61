"""One host->device transfer per step: a pytree of small 4-byte (or bool) numpy arrays packed into a
single int32 buffer on the host and unpacked by static slices inside the jitted step.

A step's inputs are ~25 small arrays; putting each one on the device separately cost more host
time than building them. The layout (`PackSpec`) depends only on shapes and dtypes, so it is a
static argument: one compiled program per bucket, exactly as before.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

_WORD_DTYPES = {np.dtype(np.int32), np.dtype(np.uint32), np.dtype(np.float32)}


class PackSpec(NamedTuple):
    treedef: Any                              # jax PyTreeDef (hashable)
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]                   # "int32" | "uint32" | "float32" | "bool"

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(int(np.prod(s)) for s in self.shapes)


def pack(tree: Any) -> tuple[np.ndarray, PackSpec]:
    """numpy pytree -> (flat int32 buffer, layout)."""
    leaves, treedef = jax.tree.flatten(tree)
    words, shapes, dtypes = [], [], []
    for leaf in leaves:
        a = np.asarray(leaf)
        if a.dtype == np.bool_:
            words.append(a.astype(np.int32).ravel())
        elif a.dtype in _WORD_DTYPES:
            words.append(np.ascontiguousarray(a).view(np.int32).ravel())
        else:
            raise ValueError(f"cannot pack dtype {a.dtype}: only int32, uint32, float32 and bool")
        shapes.append(a.shape)
        dtypes.append(str(a.dtype))
    buf = np.concatenate(words) if words else np.zeros(0, np.int32)
    return buf, PackSpec(treedef, tuple(shapes), tuple(dtypes))


def unpack(buf: jax.Array, spec: PackSpec) -> Any:
    """Inverse of `pack`, traceable: static slices of the int32 buffer, bitcast back."""
    leaves, offset = [], 0
    for shape, dtype, size in zip(spec.shapes, spec.dtypes, spec.sizes):
        words = jax.lax.slice_in_dim(buf, offset, offset + size).reshape(shape)
        offset += size
        if dtype == "bool":
            leaves.append(words != 0)
        elif dtype == "int32":
            leaves.append(words)
        else:
            leaves.append(jax.lax.bitcast_convert_type(words, jnp.dtype(dtype)))
    return jax.tree.unflatten(spec.treedef, leaves)
