"""One host->device transfer per step: a pytree of small 4-byte (or bool) numpy arrays packed into a
single int32 buffer on the host and unpacked by static slices inside the jitted step (a [R, W]
buffer when every leaf has the same leading dimension R, else a flat one).

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
    """numpy pytree -> (int32 buffer, layout). Leaves that all share their leading dimension R (the
    sampler's per-row tensors) pack as [R, words per row]; any other mix as one flat [words] row.
    Row packing matters on TPU: slicing a long 1-D buffer and reshaping it to 2-D relays the
    slice out through 1-D tiles, which took 256 bytes of temporaries per word (4 GiB for the
    sampler's widest penalty table); slicing columns of a 2-D buffer does not."""
    leaves, treedef = jax.tree.flatten(tree)
    arrays = [np.asarray(leaf) for leaf in leaves]
    rows = {a.shape[0] if a.ndim else None for a in arrays}
    by_row = len(arrays) > 1 and len(rows) == 1 and None not in rows
    r = rows.pop() if by_row else 1
    words, shapes, dtypes = [], [], []
    for a in arrays:
        if a.dtype == np.bool_:
            w = a.astype(np.int32)
        elif a.dtype in _WORD_DTYPES:
            w = np.ascontiguousarray(a).view(np.int32)
        else:
            raise ValueError(f"cannot pack dtype {a.dtype}: only int32, uint32, float32 and bool")
        words.append(w.reshape(r, -1))
        shapes.append(a.shape)
        dtypes.append(str(a.dtype))
    buf = np.concatenate(words, axis=1) if words else np.zeros((1, 0), np.int32)
    return (buf if by_row else buf[0]), PackSpec(treedef, tuple(shapes), tuple(dtypes))


def unpack(buf: jax.Array, spec: PackSpec) -> Any:
    """Inverse of `pack`, traceable: static slices of the int32 buffer (columns of a [R, W] one),
    bitcast back."""
    by_row = buf.ndim == 2
    leaves, offset = [], 0
    for shape, dtype, size in zip(spec.shapes, spec.dtypes, spec.sizes):
        width = size // buf.shape[0] if by_row else size
        words = jax.lax.slice_in_dim(buf, offset, offset + width, axis=buf.ndim - 1).reshape(shape)
        offset += width
        if dtype == "bool":
            leaves.append(words != 0)
        elif dtype == "int32":
            leaves.append(words)
        else:
            leaves.append(jax.lax.bitcast_convert_type(words, jnp.dtype(dtype)))
    return jax.tree.unflatten(spec.treedef, leaves)
