"""`ParamSpec`: one declared weight leaf (shape, dtype, logical axes), the unit `weights.abstract` is made of."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    shape: tuple[int, ...]
    dtype: Any
    axes: tuple[str | None, ...]  # logical axis names, one per dim
    init: str = "normal"          # "normal" | "ones" | "zeros" | "quantized" | "scale" | "zero_point" | "bytes" | "scale_bytes"
    contract: tuple[int, ...] = ()  # the axes a projection contracts over (quantizable leaves only)


def is_spec(x: Any) -> bool:
    return isinstance(x, ParamSpec)
