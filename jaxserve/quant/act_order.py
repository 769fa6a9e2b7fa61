"""A quantized projection whose input rows are stored in group order (GPTQ `desc_act`).

With activation order, GPTQ assigns input features to groups by `g_idx` in an arbitrary order, so
a group's rows are scattered. At load the rows are sorted by group (then every group is a
contiguous tile, as `QArray` requires), and `perm[j]` remembers which input feature stored row j
is; the matmul gathers the activations the same way: x @ W == x[..., perm] @ W[perm].
"""

from __future__ import annotations

from typing import Any

from flax import struct


@struct.dataclass
class InputPermuted:
    weight: Any   # QArray, rows (flattened contraction axes) in group order
    perm: Any     # [I] int32: the input feature of each stored row (replicated)
