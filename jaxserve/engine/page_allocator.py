"""Host-side KV page allocator: free list, reference counts, per-sequence page tables (one per KV
layer group: core/kv_groups.py; a sliding group's releases the pages behind its window,
`release_window`), and a prefix cache of full pages keyed by a hash chain (prefix_keys.py, looked up
by prefix_match.py; shipped between engines by page_shipping.py).

Every page is in exactly one state:
  free       ref 0, no hash              (on the free list)
  evictable  ref 0, hashed               (in the LRU; reused on a prefix hit, evicted oldest first)
  held       ref >= 1                    (in the page tables of `ref` live sequences)
A page is held by more than one sequence only as a read-only shared prefix: a full prefix-cache
page, or the pages a forked sample shares with its parent. Before a sequence writes into a page
another sequence also holds (the partially filled last page after a fork), `grow` gives it a private
copy and reports the (src, dst) page copy the device must do before the step.

The key of page i of a sequence is sha256(key of page i-1 || token ids of page i), and the key of
the page before the first is derived from the namespace (model id + per-tenant salt). Equal keys
therefore mean equal namespace and equal tokens at every earlier position, so different salts never
share a page.

Host tier (`num_host_pages` > 0, --kv-offload-gib): a cached page evicted from the device is
demoted, not forgotten: its key moves to a host page (least recently demoted host pages are
dropped first), and a prefix match continues into the host tier. A host hit taken by `open` is
promoted into a fresh device page. Both are recorded as transfers, drained once per step
(`drain_transfers`) and done by the device before the step, in this order: demotions (device ->
host: they read device pages before the step rewrites them), then promotions (host -> device),
then the copy-on-write copies. A host page promoted in a step is not reused until the next drain,
so no demotion of the same step overwrites it before its promotion has read it. A preempted
sequence's committed pages are cached like any other: with a host tier its resumption promotes
them back instead of recomputing (swap), unless the scheduler drops them (`forget`). The host
pages' own bookkeeping is host_tier_index.py.

State slots (`num_state_slots` > 0: a hybrid stack's linear-attention layers): every open sequence
also holds a recurrent-state slot from its opening to its freeing (state_slots.py).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence as Seq

from jaxserve.core import kv_groups
from jaxserve.engine.host_tier_index import HostTierIndex, Transfers
from jaxserve.engine.page_invariants import check_invariants
from jaxserve.engine.page_shipping import ShippedPages
from jaxserve.engine.prefix_keys import host_page, namespace_key, page_key  # noqa: F401  (host_page: re-exported)
from jaxserve.engine.prefix_match import PrefixMatch
from jaxserve.engine.state_slots import StateSlots


class NoFreePagesError(RuntimeError):
    """Raised by `grow` when the pool (free + evictable pages) cannot cover the request."""


@dataclasses.dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up (at admission)
    hits: int = 0     # of those, tokens found in the cache

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class PageAllocator(PrefixMatch, ShippedPages):
    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True,
                 num_host_pages: int = 0, windows: Seq[int | None] = (None,), num_state_slots: int = 0,
                 num_state_snapshots: int = 0) -> None:
        """windows: per KV layer group (core/kv_groups.py) its sliding window, None for full attention;
        num_state_slots, num_state_snapshots: a hybrid stack's recurrent-state slots for running
        sequences and for prefix-cache snapshots (state_slots.py; 0: none)."""
        if not isinstance(num_pages, int) or num_pages <= 0:
            raise ValueError(f"num_pages must be a positive integer, got {num_pages!r}")
        if not isinstance(page_size, int) or page_size <= 0:
            raise ValueError(f"page_size must be a positive integer, got {page_size!r}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.windows = tuple(windows)
        self.num_groups = len(self.windows)
        self.has_windows = any(w is not None for w in self.windows)  # some group releases pages
        self._free: collections.deque[int] = collections.deque(range(num_pages))
        self._ref = [0] * num_pages
        self._page_key: dict[int, bytes] = {}          # hashed page -> its key (group-tagged: _group_key)
        self._cached: dict[bytes, int] = {}            # key -> page (the prefix cache)
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()  # LRU, oldest first
        # per sequence, per group: the page table (entries before _lo are released, stale ids)
        self._tables: dict[str, list[list[int]]] = {}
        self._lo: dict[str, list[int]] = {}
        # keys of a sequence's full pages, in order (the chain continues from the last one)
        self._seq_keys: dict[str, list[bytes]] = {}
        self._seq_root: dict[str, bytes] = {}
        self.stats = PrefixCacheStats()
        # host tier
        self.num_host_pages = num_host_pages if enable_prefix_caching else 0
        self.host = HostTierIndex(self.num_host_pages)
        self.host_hit_tokens = 0  # prompt tokens whose pages came back from the host tier
        self.states = StateSlots(num_state_slots, num_state_snapshots if enable_prefix_caching else 0)

    # ---- queries -------------------------------------------------------------------------------

    @property
    def num_free_pages(self) -> int:
        """Pages a new allocation can take: truly free plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_evictable_pages(self) -> int:
        return len(self._evictable)

    def pages_needed(self, num_tokens: int) -> int:
        """Entries of one group's table covering `num_tokens` tokens."""
        return -(-num_tokens // self.page_size)

    def first_needed_page(self, group: int, position: int) -> int:
        """The first page of `group` a query at `position` or later may read (kv_groups.py)."""
        return kv_groups.first_needed_page(self.windows[group], position, self.page_size)

    def pages_to_hold(self, num_tokens: int, chunk_tokens: int) -> int:
        """The most pages one sequence of `num_tokens` tokens holds, in chunks of `chunk_tokens`."""
        return kv_groups.pages_to_hold(self.windows, num_tokens, self.page_size, chunk_tokens)

    def max_tokens(self, limit: int, chunk_tokens: int) -> int:
        """The longest sequence (at most `limit` tokens) whose pages_to_hold fit in the pool."""
        return kv_groups.max_tokens(self.windows, self.num_pages, self.page_size, chunk_tokens, limit)

    @property
    def num_host_pages_used(self) -> int:
        return self.host.num_used

    def can_allocate(self, num_new_pages: int, holding: Seq[int] = ()) -> bool:
        """Whether `num_new_pages` fresh pages fit after taking references on `holding` (pages from
        `match_prefix`; the evictable ones among them stop being allocatable once held, and each
        host hit needs a device page to come back into)."""
        taken = sum(1 for p in holding if p is not None and (p < 0 or self._ref[p] == 0))
        return num_new_pages <= self.num_free_pages - taken

    def fits(self, cached: Seq[Seq[int | None]], num_tokens: int) -> bool:
        """Whether a sequence opened on `cached` (from `match_groups`) can grow to `num_tokens`."""
        new = self.num_groups * (self.pages_needed(num_tokens) - len(cached[0]))
        return self.can_allocate(new, [p for pages in cached for p in pages])

    def has_sequence(self, seq_id: str) -> bool:
        return seq_id in self._tables

    def page_table(self, seq_id: str) -> list[int]:
        """The first group's table (the live list; a uniform stack's only one)."""
        return self._tables[seq_id][0]

    def page_tables(self, seq_id: str) -> list[list[int]]:
        """Every group's table (live lists), in group order."""
        return self._tables[seq_id]

    def tables_or_empty(self, seq_id: str) -> list[list[int]]:
        """page_tables, or one empty table once the sequence has given its pages back."""
        return self._tables.get(seq_id) or [[]]

    def held_pages(self, seq_id: str) -> list[int]:
        """The pages `seq_id` holds a reference on, every group's."""
        return [p for table, lo in zip(self._tables[seq_id], self._lo[seq_id]) for p in table[lo:]]

    def ref_count(self, page: int) -> int:
        return self._ref[page]

    def is_cached(self, page: int) -> bool:
        return page in self._page_key

    # ---- sequence lifetime ---------------------------------------------------------------------

    def open(self, seq_id: str, namespace: str, cached_pages: Seq[int] = (),
             num_query_tokens: int = 0) -> None:
        """Starts `seq_id`'s page table with references on `cached_pages` (from `match_prefix`) and
        records the prefix-cache lookup of `num_query_tokens` prompt tokens (one layer group)."""
        for page in cached_pages:
            if page >= 0 and page not in self._page_key or page < 0 and not self.host.holds(-1 - page):
                raise ValueError(f"{'host ' if page < 0 else ''}page {page if page >= 0 else -1 - page} is not "
                                 "a cached page")
        keys = [self._page_key[p] if p >= 0 else self.host.key_of(-1 - p) for p in cached_pages]
        self.open_groups(seq_id, namespace, [list(cached_pages)], keys, num_query_tokens)

    def open_groups(self, seq_id: str, namespace: str, cached: Seq[Seq[int | None]], keys: Seq[bytes],
                    num_query_tokens: int = 0) -> None:
        """Starts `seq_id`'s tables with references on `cached` (from `match_groups`: per group, None
        where its window no longer reads), `keys` the prefix keys they cover."""
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id!r} already has a page table")
        if len(cached) != self.num_groups:
            raise ValueError(f"{len(cached)} groups of cached pages for {self.num_groups} layer groups")
        self.states.take(seq_id)  # first: running out of slots leaves nothing half open
        n = len(cached[0])
        tables, los, from_host = [], [], set()  # from_host: page indices some group promotes
        for pages in cached:  # device hits first: a promotion's fresh page must not evict one of them
            for page in pages:
                if page is not None and page >= 0:
                    self._take(page)
        for pages in cached:
            table = [0 if page is None else page for page in pages]
            lo = next((i for i, page in enumerate(pages) if page is not None), len(pages))
            for i in range(lo, len(table)):
                if table[i] < 0:  # a host hit: back into a fresh device page before the step
                    key = self.host.reserve(-1 - table[i])
                    host, table[i] = -1 - table[i], self._pop_fresh()
                    self.host.promoted(host, table[i])
                    self._cached[key] = table[i]
                    self._page_key[table[i]] = key
                    from_host.add(i)
            tables.append(table)
            los.append(lo)
        self.host_hit_tokens += len(from_host) * self.page_size
        self._tables[seq_id] = tables
        self._lo[seq_id] = los
        self._seq_keys[seq_id] = list(keys[:n])
        self._seq_root[seq_id] = namespace_key(namespace)
        if num_query_tokens:
            self.stats.queries += num_query_tokens
            self.stats.hits += n * self.page_size

    def release_window(self, seq_id: str, position: int) -> None:
        """Releases the pages of `seq_id`'s sliding groups that no query at `position` or later
        reads (they become evictable when cached, else free). Their entries stay as stale ids."""
        if not self.has_windows:
            return
        tables, los = self._tables[seq_id], self._lo[seq_id]
        for g, window in enumerate(self.windows):
            if window is None:
                continue
            table, lo = tables[g], los[g]
            new_lo = min(self.first_needed_page(g, position), len(table))
            for i in range(lo, new_lo):
                self._release(table[i])
            if new_lo > lo:
                los[g] = new_lo

    def writable(self, seq_id: str, position: int) -> bool:
        """Whether every group's page under `position` is held and private to `seq_id`: a one-token
        write there needs no growth (grow would change nothing). The usual decode; O(groups)."""
        i = position // self.page_size
        ref = self._ref
        for table in self._tables[seq_id]:
            if i >= len(table) or ref[table[i]] != 1:
                return False
        return True

    def pages_to_grow(self, seq_id: str, num_tokens: int, write_start: int) -> int:
        """Fresh pages `grow(seq_id, num_tokens, write_start)` would take (new pages plus private
        copies of shared pages that the write [write_start, num_tokens) touches)."""
        needed = -(-num_tokens // self.page_size)
        ref = self._ref
        total = 0
        for table, lo in zip(self._tables[seq_id], self._lo[seq_id]):
            have = len(table)
            for i in range(max(lo, write_start // self.page_size), min(have, needed)):
                if ref[table[i]] > 1:
                    total += 1
            if needed > have:
                total += needed - have
        return total

    def grow(self, seq_id: str, num_tokens: int, write_start: int) -> list[tuple[int, int]]:
        """Makes `seq_id`'s tables cover `num_tokens` tokens, with a private page under every position
        in [write_start, num_tokens). Returns the (src, dst) copies the device must do first.
        Raises NoFreePagesError, changing nothing, when the pool cannot cover it."""
        need = self.pages_to_grow(seq_id, num_tokens, write_start)
        if not need:  # the usual decode: its page is its own and covers the token
            return []
        if need > self.num_free_pages:
            raise NoFreePagesError(f"sequence {seq_id!r} needs {need} pages, {self.num_free_pages} free")
        needed = -(-num_tokens // self.page_size)
        copies = []
        for table, lo in zip(self._tables[seq_id], self._lo[seq_id]):
            for i in range(max(lo, write_start // self.page_size), min(len(table), needed)):
                src = table[i]
                if self._ref[src] > 1:  # shared (after a fork): copy on write
                    dst = self._pop_fresh()
                    self._ref[src] -= 1
                    table[i] = dst
                    copies.append((src, dst))
            while len(table) < needed:
                table.append(self._pop_fresh())
        return copies

    def commit(self, seq_id: str, token_ids: Seq[int], start: int = 0) -> None:
        """Enters the full pages of `token_ids` (K/V computed; from position `start`, a page boundary
        at or before the first uncommitted page: no need to pass the whole context) into the prefix
        cache. Keyed pages are skipped; a page whose key another page holds stays private, and so
        does a sliding group's page already released."""
        if not self.enable_prefix_caching:
            return
        keys = self._seq_keys[seq_id]
        tables, los = self._tables[seq_id], self._lo[seq_id]
        ps = self.page_size
        if start % ps or start > len(keys) * ps:
            raise ValueError(f"commit from position {start}: not a page boundary at or before page {len(keys)}")
        full = min((start + len(token_ids)) // ps, len(tables[0]))
        for i in range(len(keys), full):
            parent = keys[-1] if keys else self._seq_root[seq_id]
            key = page_key(parent, token_ids[i * ps - start:(i + 1) * ps - start])
            keys.append(key)
            for g, (table, lo) in enumerate(zip(tables, los)):
                if i < lo:
                    continue
                page, gkey = table[i], self._group_key(g, key)
                if gkey not in self._cached and page not in self._page_key:
                    self._cached[gkey] = page
                    self._page_key[page] = gkey

    def num_committed_pages(self, seq_id: str) -> int:
        return len(self._seq_keys[seq_id])

    def fork(self, parent_id: str, child_id: str) -> None:
        """`child_id` shares every page of `parent_id` (read-only until `grow` copies on write)."""
        if child_id in self._tables:
            raise ValueError(f"sequence {child_id!r} already has a page table")
        self.states.fork(parent_id, child_id)  # first: running out of slots leaves nothing half done
        for page in self.held_pages(parent_id):
            self._ref[page] += 1
        self._tables[child_id] = [list(table) for table in self._tables[parent_id]]
        self._lo[child_id] = list(self._lo[parent_id])
        self._seq_keys[child_id] = list(self._seq_keys[parent_id])
        self._seq_root[child_id] = self._seq_root[parent_id]

    def free(self, seq_id: str) -> None:
        """Drops `seq_id`'s references. Pages reaching 0 become evictable if cached, else free.
        Tail pages are released first so the LRU evicts a sequence's tail before its head."""
        tables, los = self._tables.pop(seq_id), self._lo.pop(seq_id)
        del self._seq_keys[seq_id], self._seq_root[seq_id]
        self.states.free(seq_id)
        for table, lo in zip(tables, los):
            for page in reversed(table[lo:]):
                self._release(page)

    def reset_prefix_cache(self) -> int:
        """Forgets every evictable cached page (held pages keep their keys) and the host tier.
        Returns device pages freed."""
        n = len(self._evictable)
        while self._evictable:
            page, _ = self._evictable.popitem(last=False)
            self._unkey(page)
            self._free.append(page)
        self.host.reset()
        self.states.reset()
        return n

    def forget(self, seq_id: str) -> None:
        """Drops the keys of `seq_id`'s pages that nobody else holds, then frees it: its K/V will
        be recomputed, not kept for a prefix hit (a preemption that chose recompute over swap)."""
        for page in self.held_pages(seq_id):
            if self._ref[page] == 1 and page in self._page_key:
                self._unkey(page)
        self.free(seq_id)

    def drain_transfers(self) -> Transfers:
        """The demotions and promotions since the last drain (the device does them before the
        step that was planned meanwhile); host pages promoted since become free again."""
        return self.host.drain()

    # ---- internals -----------------------------------------------------------------------------

    def _release(self, page: int) -> None:
        self._ref[page] -= 1
        if self._ref[page] == 0:
            if page in self._page_key:
                self._evictable[page] = None
            else:
                self._free.append(page)

    def _take(self, page: int) -> None:
        if self._ref[page] == 0:
            del self._evictable[page]  # a cached page is reused: it leaves the LRU
        self._ref[page] += 1

    def _pop_fresh(self) -> int:
        if self._free:
            page = self._free.popleft()
        else:
            page, _ = self._evictable.popitem(last=False)  # evict the least recently released
            key = self._page_key[page]
            self._unkey(page)
            if self.num_host_pages:
                self.host.demote(page, key)
        self._ref[page] = 1
        return page

    def _unkey(self, page: int) -> None:
        key = self._page_key.pop(page)
        del self._cached[key]

    # ---- checks (tests) ------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raises AssertionError when the bookkeeping is inconsistent (page_invariants.py)."""
        check_invariants(self)
