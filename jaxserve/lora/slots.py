"""Adapters stacked into a fixed number of slots (host, numpy): the arrays the forward reads.

Per layer and module: a [*in, N, R] and b [N, R, *out] for N slots of rank R (every adapter padded
to R with zero columns/rows, which changes nothing: the padded rank directions are zero in both
factors). A slot without an adapter, or an adapter that does not adapt that module or layer, is
zero. Shapes depend only on (N, R, the model): putting another adapter in a slot never recompiles.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from jaxserve.core.config import ModelConfig
from jaxserve.lora.adapter import MODULES, LoraAdapter, shapes

# one layer: module -> (a [*in, N, R], b [N, R, *out])
LoraLayer = dict[str, tuple[np.ndarray, np.ndarray]]


def empty_slots(cfg: ModelConfig, num_slots: int, max_rank: int, modules: Sequence[str] = MODULES
                ) -> list[LoraLayer]:
    dims = shapes(cfg)
    return [{m: (np.zeros((*dims[m][0], num_slots, max_rank), np.float32),
                 np.zeros((num_slots, max_rank, *dims[m][1]), np.float32)) for m in modules}
            for _ in range(cfg.num_layers)]


def put(layers: list[LoraLayer], slot: int, adapter: LoraAdapter | None) -> None:
    """Writes `adapter`'s factors into `slot` (zeros where it adapts nothing; None clears it)."""
    for i, layer in enumerate(layers):
        for module, (a, b) in layer.items():
            a[..., slot, :] = 0.0
            b[slot] = 0.0
            if adapter is None or (i, module) not in adapter.factors:
                continue
            fa, fb = adapter.factors[(i, module)]
            if module not in layer:
                continue
            r = fa.shape[-1]
            if r > a.shape[-1]:
                raise ValueError(f"LoRA adapter {adapter.name}: rank {r} exceeds the slots' rank {a.shape[-1]}")
            a[..., slot, :r] = fa
            b[slot, :r] = fb


def stack(adapters: Sequence[LoraAdapter | None], cfg: ModelConfig, max_rank: int) -> list[LoraLayer]:
    """Slot i holds adapters[i] (None: an empty slot)."""
    layers = empty_slots(cfg, len(adapters), max_rank)
    for slot, adapter in enumerate(adapters):
        put(layers, slot, adapter)
    return layers
