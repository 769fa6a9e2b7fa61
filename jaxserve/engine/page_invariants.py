"""The page allocator's bookkeeping checked whole (tests and debugging): every page in exactly one
state, reference counts equal to the tables holding a page, keys consistent with the cache, shared
pages only as common prefixes."""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jaxserve.engine.page_allocator import PageAllocator


def check_invariants(alloc: "PageAllocator") -> None:
    """Raises AssertionError when `alloc`'s bookkeeping is inconsistent."""
    free = set(alloc._free)
    assert len(free) == len(alloc._free), "free list holds a page twice"
    holders: dict[int, list[tuple[str, int, int]]] = collections.defaultdict(list)
    for seq_id, tables in alloc._tables.items():
        assert len(tables) == alloc.num_groups == len(alloc._lo[seq_id]), f"{seq_id}: tables per group"
        assert len({len(t) for t in tables}) == 1, f"{seq_id}: groups' tables of different lengths"
        held = alloc.held_pages(seq_id)
        assert len(held) == len(set(held)), f"{seq_id} holds a page twice"
        for g, (table, lo) in enumerate(zip(tables, alloc._lo[seq_id])):
            assert lo == 0 or alloc.windows[g] is not None, f"{seq_id}: a full group released pages"
            for idx in range(lo, len(table)):
                holders[table[idx]].append((seq_id, g, idx))
    for page in range(alloc.num_pages):
        states = [page in alloc._evictable, page in free, alloc._ref[page] > 0]
        assert sum(states) == 1, f"page {page} is in {sum(states)} states (evictable, free, held)"
        assert alloc._ref[page] == len(holders.get(page, ())), (
            f"page {page}: ref {alloc._ref[page]} != {len(holders.get(page, ()))} page tables")
        if page in alloc._evictable:
            assert page in alloc._page_key, f"evictable page {page} has no key"
        if page in free:
            assert page not in alloc._page_key, f"free page {page} still has a key"
    for key, page in alloc._cached.items():
        assert alloc._page_key.get(page) == key, f"cache entry for page {page} disagrees"
    assert len(alloc._cached) == len(alloc._page_key)
    # Shared read-only: the page sits at the same place in every table holding it, behind the
    # same tokens (same key chain; with caching off only forks share, so the same pages).
    prefix_of = alloc._seq_keys if alloc.enable_prefix_caching else {s: t[0] for s, t in alloc._tables.items()}
    for page, where in holders.items():
        first_seq, group, idx = where[0]
        for seq_id, other_group, other_idx in where[1:]:
            assert (other_group, other_idx) == (group, idx) and \
                prefix_of[seq_id][:idx] == prefix_of[first_seq][:idx], (
                    f"page {page} shared by {first_seq} and {seq_id} not as a common prefix")
    alloc.host.check_invariants()
    for seq_id, keys in alloc._seq_keys.items():
        tables, los = alloc._tables[seq_id], alloc._lo[seq_id]
        assert len(keys) <= len(tables[0]), f"{seq_id} has keys past its table"
        for g, (table, lo) in enumerate(zip(tables, los)):
            for i in range(lo, len(keys)):
                page = table[i]
                if page in alloc._page_key:
                    assert alloc._page_key[page] == alloc._group_key(g, keys[i]), (
                        f"{seq_id}: page {page} keyed for other tokens")
