"""Layer groups of the KV pool: how a stack that mixes sliding and full attention shares one pool
of pages so that sliding layers keep only their window.

Layers of the same attention kind (the same window, or full) are cut, in layer order, into groups
of `num_arrays` layers (the smallest kind's layer count; a kind's last group may be shorter). The
pool holds `num_arrays` arrays of pages ([num_pages, page_size, kv_heads, head_dim] each), and a
layer reads and writes the array at its place in its group through its group's page
table. A page id therefore names one page of every pool array, and belongs to one group at a time:
the pool is one free list whatever the mix of kinds. A full-attention group's table covers every
position; a sliding group's table releases the pages that fell out of its window (their entries
stay in the table as stale ids that no attention reads: every backend starts at the window).

gpt-oss (12 sliding, 12 full layers): two groups of 12. Gemma 3 27B (52 sliding, 10 full): one
full group and six sliding groups of 10 (the last of 2). A stack of one kind is one group whose
arrays are its layers, exactly the pool of a uniform model. Pure Python: the scheduler's side
reads it too.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class KVGroups:
    windows: tuple[int | None, ...]   # per group: its sliding window in tokens; None: full attention
    layer_group: tuple[int, ...]      # per layer: its group
    layer_array: tuple[int, ...]      # per layer: the pool array it reads and writes
    num_arrays: int                    # pool arrays (the largest group's layer count)

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    def pages_to_hold(self, num_tokens: int, page_size: int, chunk_tokens: int) -> int:
        return pages_to_hold(self.windows, num_tokens, page_size, chunk_tokens)

    def max_tokens(self, num_pages: int, page_size: int, chunk_tokens: int, limit: int) -> int:
        return max_tokens(self.windows, num_pages, page_size, chunk_tokens, limit)

    def sequences_held(self, num_pages: int, num_tokens: int, page_size: int, chunk_tokens: int) -> float:
        return sequences_held(self.windows, num_pages, num_tokens, page_size, chunk_tokens)

    def describe(self) -> str:
        """The groups in words, for the start-up block and the plan."""
        if self.num_groups == 1 and self.windows[0] is None:
            return "one layer group"
        sliding = sorted({w for w in self.windows if w is not None})
        return (f"{self.num_groups} layer groups of {self.num_arrays} layers, "
                f"{sum(w is not None for w in self.windows)} sliding (window {', '.join(map(str, sliding))}: "
                f"they keep only the window's pages)")


def first_needed_page(window: int | None, position: int, page_size: int) -> int:
    """The first page a layer group with `window` (None: full attention) reads for a query at
    `position` or later: every page for full attention, else the page holding position - window + 1."""
    return 0 if window is None else max(0, position - window + 1) // page_size


def pages_to_hold(windows: tuple[int | None, ...], num_tokens: int, page_size: int, chunk_tokens: int) -> int:
    """The most pages one sequence of `num_tokens` tokens holds, computed in chunks of at most
    `chunk_tokens`: every page in a full group, in a sliding group the window's and the chunk's
    (plus the page a window starts inside)."""
    full = -(-num_tokens // page_size)
    sliding = lambda w: min(full, -(-(w - 1 + chunk_tokens) // page_size) + 1)  # noqa: E731
    return sum(full if w is None else sliding(w) for w in windows)


def max_tokens(windows: tuple[int | None, ...], num_pages: int, page_size: int, chunk_tokens: int,
               limit: int) -> int:
    """The longest sequence (at most `limit` tokens) whose pages_to_hold fit in `num_pages`."""
    lo, hi = 0, limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if pages_to_hold(windows, mid, page_size, chunk_tokens) <= num_pages:
            lo = mid
        else:
            hi = mid - 1
    return lo


def kv_groups(layer_windows: tuple[int | None, ...], paged: tuple[bool, ...] | None = None) -> KVGroups:
    """The grouping of a stack whose layer i has window layer_windows[i] (None: full attention).
    paged: per layer, whether it keeps K/V pages at all (a linear-attention layer keeps a recurrent
    state instead: group and array -1); None: every layer."""
    if paged is not None and not all(paged):
        attending = [i for i, p in enumerate(paged) if p]
        if not attending:
            raise ValueError("a stack needs at least one attention layer for the KV pool")
        inner = kv_groups(tuple(layer_windows[i] for i in attending))
        group, array = [-1] * len(paged), [-1] * len(paged)
        for j, i in enumerate(attending):
            group[i], array[i] = inner.layer_group[j], inner.layer_array[j]
        return dataclasses.replace(inner, layer_group=tuple(group), layer_array=tuple(array))
    n = len(layer_windows)
    kinds = list(dict.fromkeys(sorted(set(layer_windows), key=lambda w: (w is not None, w or 0))))
    if len(kinds) == 1:
        return KVGroups((kinds[0],), (0,) * n, tuple(range(n)), n)
    layers_of = {kind: [i for i, w in enumerate(layer_windows) if w == kind] for kind in kinds}
    size = min(len(layers) for layers in layers_of.values())
    windows, group, array = [], [0] * n, [0] * n
    for kind in kinds:  # full attention first: group 0 is a full group when the stack has one
        layers = layers_of[kind]
        for start in range(0, len(layers), size):
            for j, layer in enumerate(layers[start:start + size]):
                group[layer], array[layer] = len(windows), j
            windows.append(kind)
    return KVGroups(tuple(windows), tuple(group), tuple(array), size)


def sequences_held(windows: tuple[int | None, ...], num_pages: int, num_tokens: int, page_size: int,
                   chunk_tokens: int) -> float:
    """How many sequences of `num_tokens` tokens `num_pages` hold at once, decoding: each holds a
    sliding group's window only, and the pool keeps room for one step's prefill chunk in every
    sliding group (the chunk's pages are held until the window moves past them)."""
    reserve = sum(w is not None for w in windows) * -(-chunk_tokens // page_size)
    return max(0, num_pages - reserve) / pages_to_hold(windows, num_tokens, page_size, 1)


def kept_windows(windows: tuple[int | None, ...], speculative_config: Any = None) -> tuple[int | None, ...]:
    """The windows the allocator releases pages behind, per group: the model's, except that a
    proposer running its own layers over the target's first group's tables (a draft model, an
    EAGLE-3 or MTP head: full attention) needs that group to keep every page."""
    if getattr(speculative_config, "model_proposer", False) and windows[0] is not None:
        return (None, *windows[1:])
    return windows


TPU_LANES = 128


def fused_kv(head_dim: int, platform: str) -> bool:
    """Whether a pool array holds each head's K and V side by side, [..., 2 x head_dim] (K in the
    first head_dim lanes): on a TPU, for heads narrower than a 128-lane tile whose K and V together
    fill whole tiles (gpt-oss's 64). A narrower array is laid out by XLA:TPU with its pages minor,
    and every forward step then copied each pool array into the layouts the KV scatter and the
    Mosaic kernel read: twice the pool in temporaries at any bucket, decode included (a 64 MiB pool,
    130 MiB of temporaries; docs/BENCHMARKS.md). Side by side, a page is tile-dense with no padding;
    model/paged.py gives the kernel that array as both K and V, q zero in the V lanes (q.[k|v] = q.k)
    and reads p.v from the output's V lanes."""
    return platform == "tpu" and head_dim % TPU_LANES != 0 and 2 * head_dim % TPU_LANES == 0


def pool_head_dim(head_dim: int, platform: str, *, latent: bool = False) -> int:
    """The lanes one head's K (or V) takes in the pool on `platform`: a TPU zero-pads a head that is
    neither whole tiles nor fused (fused_kv) to whole 128-lane tiles, for the same reason. A latent
    row (multi-head latent attention: one array, never fused) is padded whatever its width: DeepSeek's
    576 lanes as they were made XLA:TPU copy the whole pool into the kernel's layout every step."""
    if platform != "tpu" or (not latent and fused_kv(head_dim, platform)):
        return head_dim
    return -(-head_dim // TPU_LANES) * TPU_LANES
