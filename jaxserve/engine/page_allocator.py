"""Host-side KV page allocator: free list, reference counts, per-sequence page tables, and a
prefix cache of full pages keyed by a hash chain.

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
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
from array import array
from collections.abc import Sequence as Seq

from jaxserve.engine.host_tier_index import HostTierIndex, Transfers


class NoFreePagesError(RuntimeError):
    """Raised by `grow` when the pool (free + evictable pages) cannot cover the request."""


@dataclasses.dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up (at admission)
    hits: int = 0     # of those, tokens found in the cache

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


def namespace_key(namespace: str) -> bytes:
    return hashlib.sha256(b"jaxserve-prefix\x00" + namespace.encode("utf-8")).digest()


def page_key(parent: bytes, tokens: Seq[int]) -> bytes:
    return hashlib.sha256(parent + array("q", tokens).tobytes()).digest()


def host_page(index: int) -> int:
    """How `match_prefix` lists a hit in the host tier: negative, so device pages stay >= 0."""
    return -1 - index


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True,
                 num_host_pages: int = 0) -> None:
        if not isinstance(num_pages, int) or num_pages <= 0:
            raise ValueError(f"num_pages must be a positive integer, got {num_pages!r}")
        if not isinstance(page_size, int) or page_size <= 0:
            raise ValueError(f"page_size must be a positive integer, got {page_size!r}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self._free: collections.deque[int] = collections.deque(range(num_pages))
        self._ref = [0] * num_pages
        self._page_key: dict[int, bytes] = {}          # hashed page -> its key
        self._cached: dict[bytes, int] = {}            # key -> page (the prefix cache)
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()  # LRU, oldest first
        self._tables: dict[str, list[int]] = {}
        # keys of a sequence's full pages, in order (the chain continues from the last one)
        self._seq_keys: dict[str, list[bytes]] = {}
        self._seq_root: dict[str, bytes] = {}
        self.stats = PrefixCacheStats()
        # host tier
        self.num_host_pages = num_host_pages if enable_prefix_caching else 0
        self.host = HostTierIndex(self.num_host_pages)
        self.host_hit_tokens = 0  # prompt tokens whose pages came back from the host tier

    # ---- queries -------------------------------------------------------------------------------

    @property
    def num_free_pages(self) -> int:
        """Pages a new allocation can take: truly free plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_evictable_pages(self) -> int:
        return len(self._evictable)

    def pages_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    @property
    def num_host_pages_used(self) -> int:
        return self.host.num_used

    def can_allocate(self, num_new_pages: int, holding: Seq[int] = ()) -> bool:
        """Whether `num_new_pages` fresh pages fit after taking references on `holding` (pages from
        `match_prefix`; the evictable ones among them stop being allocatable once held, and each
        host hit needs a device page to come back into)."""
        taken = sum(1 for p in holding if p < 0 or self._ref[p] == 0)
        return num_new_pages <= self.num_free_pages - taken

    def has_sequence(self, seq_id: str) -> bool:
        return seq_id in self._tables

    def page_table(self, seq_id: str) -> list[int]:
        return self._tables[seq_id]

    def ref_count(self, page: int) -> int:
        return self._ref[page]

    def is_cached(self, page: int) -> bool:
        return page in self._page_key

    def prefix_keys(self, token_ids: Seq[int], namespace: str) -> list[bytes]:
        """The prefix-cache keys of the full pages of `token_ids` before its last token (what
        `match_prefix` looks up); a caller may keep them while the tokens do not change."""
        if not self.enable_prefix_caching or len(token_ids) < 2:
            return []
        ps = self.page_size
        key = namespace_key(namespace)
        keys = []
        for i in range((len(token_ids) - 1) // ps):
            key = page_key(key, token_ids[i * ps:(i + 1) * ps])
            keys.append(key)
        return keys

    def match_prefix(self, token_ids: Seq[int], namespace: str) -> tuple[list[int], int]:
        """Longest run of cached full pages that prefixes `token_ids` in `namespace`.

        Never covers the last token: it must be computed so the step has logits to sample from.
        Pure lookup: takes no references and counts nothing (see `open`). A page found only in the
        host tier is listed as `host_page(index)` (negative).
        """
        return self.match_keys(self.prefix_keys(token_ids, namespace))

    def match_keys(self, keys: Seq[bytes]) -> tuple[list[int], int]:
        """match_prefix for tokens whose `prefix_keys` the caller kept (no hashing)."""
        pages: list[int] = []
        for key in keys:
            page = self._cached.get(key)
            if page is None:
                host = self.host.lookup(key)
                if host is None:
                    break
                page = host_page(host)
            pages.append(page)
        return pages, len(pages) * self.page_size

    # ---- sequence lifetime ---------------------------------------------------------------------

    def open(self, seq_id: str, namespace: str, cached_pages: Seq[int] = (),
             num_query_tokens: int = 0) -> None:
        """Starts `seq_id`'s page table with references on `cached_pages` (from `match_prefix`) and
        records the prefix-cache lookup of `num_query_tokens` prompt tokens."""
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id!r} already has a page table")
        for page in cached_pages:
            if page >= 0 and page not in self._page_key or page < 0 and not self.host.holds(-1 - page):
                raise ValueError(f"{'host ' if page < 0 else ''}page {page if page >= 0 else -1 - page} is not "
                                 "a cached page")
        table = list(cached_pages)
        for page in table:  # device hits first: a promotion's fresh page must not evict one of them
            if page >= 0:
                self._take(page)
        for i, page in enumerate(table):
            if page < 0:  # a host hit: back into a fresh device page before the step
                key = self.host.reserve(-1 - page)
                table[i] = self._pop_fresh()
                self.host.promoted(-1 - page, table[i])
                self._cached[key] = table[i]
                self._page_key[table[i]] = key
                self.host_hit_tokens += self.page_size
        keys = [self._page_key[page] for page in table]
        self._tables[seq_id] = table
        self._seq_keys[seq_id] = keys
        self._seq_root[seq_id] = namespace_key(namespace)
        if num_query_tokens:
            self.stats.queries += num_query_tokens
            self.stats.hits += len(cached_pages) * self.page_size

    def pages_to_grow(self, seq_id: str, num_tokens: int, write_start: int) -> int:
        """Fresh pages `grow(seq_id, num_tokens, write_start)` would take (new pages plus private
        copies of shared pages that the write [write_start, num_tokens) touches)."""
        table = self._tables[seq_id]
        needed, have = -(-num_tokens // self.page_size), len(table)
        ref = self._ref
        cow = 0
        for i in range(write_start // self.page_size, min(have, needed)):
            if ref[table[i]] > 1:
                cow += 1
        return cow + (needed - have if needed > have else 0)

    def grow(self, seq_id: str, num_tokens: int, write_start: int) -> list[tuple[int, int]]:
        """Makes `seq_id`'s table cover `num_tokens` tokens, with a private page under every position
        in [write_start, num_tokens). Returns the (src, dst) copies the device must do first.
        Raises NoFreePagesError, changing nothing, when the pool cannot cover it."""
        need = self.pages_to_grow(seq_id, num_tokens, write_start)
        if not need:  # the usual decode: its page is its own and covers the token
            return []
        if need > self.num_free_pages:
            raise NoFreePagesError(f"sequence {seq_id!r} needs {need} pages, {self.num_free_pages} free")
        table = self._tables[seq_id]
        needed = -(-num_tokens // self.page_size)
        copies = []
        for i in range(write_start // self.page_size, min(len(table), needed)):
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
        cache. Keyed pages are skipped; a page whose key another page holds stays private."""
        if not self.enable_prefix_caching:
            return
        keys = self._seq_keys[seq_id]
        table = self._tables[seq_id]
        ps = self.page_size
        if start % ps or start > len(keys) * ps:
            raise ValueError(f"commit from position {start}: not a page boundary at or before page {len(keys)}")
        full = min((start + len(token_ids)) // ps, len(table))
        for i in range(len(keys), full):
            parent = keys[-1] if keys else self._seq_root[seq_id]
            key = page_key(parent, token_ids[i * ps - start:(i + 1) * ps - start])
            keys.append(key)
            page = table[i]
            if key not in self._cached and page not in self._page_key:
                self._cached[key] = page
                self._page_key[page] = key

    def num_committed_pages(self, seq_id: str) -> int:
        return len(self._seq_keys[seq_id])

    def fork(self, parent_id: str, child_id: str) -> None:
        """`child_id` shares every page of `parent_id` (read-only until `grow` copies on write)."""
        if child_id in self._tables:
            raise ValueError(f"sequence {child_id!r} already has a page table")
        table = self._tables[parent_id]
        for page in table:
            self._ref[page] += 1
        self._tables[child_id] = list(table)
        self._seq_keys[child_id] = list(self._seq_keys[parent_id])
        self._seq_root[child_id] = self._seq_root[parent_id]

    def free(self, seq_id: str) -> None:
        """Drops `seq_id`'s references. Pages reaching 0 become evictable if cached, else free.
        Tail pages are released first so the LRU evicts a sequence's tail before its head."""
        table = self._tables.pop(seq_id)
        del self._seq_keys[seq_id], self._seq_root[seq_id]
        for page in reversed(table):
            self._ref[page] -= 1
            if self._ref[page] == 0:
                if page in self._page_key:
                    self._evictable[page] = None
                else:
                    self._free.append(page)

    def reset_prefix_cache(self) -> int:
        """Forgets every evictable cached page (held pages keep their keys) and the host tier.
        Returns device pages freed."""
        n = len(self._evictable)
        while self._evictable:
            page, _ = self._evictable.popitem(last=False)
            self._unkey(page)
            self._free.append(page)
        self.host.reset()
        return n

    def forget(self, seq_id: str) -> None:
        """Drops the keys of `seq_id`'s pages that nobody else holds, then frees it: its K/V will
        be recomputed, not kept for a prefix hit (a preemption that chose recompute over swap)."""
        for page in self._tables[seq_id]:
            if self._ref[page] == 1 and page in self._page_key:
                self._unkey(page)
        self.free(seq_id)

    def device_prefix(self, token_ids: Seq[int], namespace: str) -> list[int]:
        """The device pages caching `token_ids`' full pages from the start (a host hit ends it):
        what a prefill instance exports (every full page, the last token's included)."""
        ps, key, pages = self.page_size, namespace_key(namespace), []
        for i in range(len(token_ids) // ps):
            key = page_key(key, token_ids[i * ps:(i + 1) * ps])
            page = self._cached.get(key)
            if page is None:
                break
            pages.append(page)
        return pages

    def import_pages(self, token_ids: Seq[int], namespace: str, num_pages: int) -> list[tuple[int, int]]:
        """Caches the first `num_pages` full pages of `token_ids` whose K/V arrives from elsewhere (a
        prefill instance): each one not cached yet gets a fresh device page, keyed and evictable.
        Returns (index among the pages, device page) for the pages the caller must fill before any
        step reads them; none when the pool cannot take them all."""
        if not self.enable_prefix_caching:
            return []
        ps, key, todo = self.page_size, namespace_key(namespace), []
        for i in range(num_pages):
            key = page_key(key, token_ids[i * ps:(i + 1) * ps])
            if key not in self._cached:
                todo.append((i, key))
        if len(todo) > self.num_free_pages:
            return []
        out = []
        for i, key in todo:
            page = self._pop_fresh()
            self._ref[page] = 0
            self._cached[key] = page
            self._page_key[page] = key
            self._evictable[page] = None
            out.append((i, page))
        return out

    def drain_transfers(self) -> Transfers:
        """The demotions and promotions since the last drain (the device does them before the
        step that was planned meanwhile); host pages promoted since become free again."""
        return self.host.drain()

    # ---- internals -----------------------------------------------------------------------------

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
        """Raises AssertionError when the bookkeeping is inconsistent."""
        free = set(self._free)
        assert len(free) == len(self._free), "free list holds a page twice"
        holders: dict[int, list[tuple[str, int]]] = collections.defaultdict(list)
        for seq_id, table in self._tables.items():
            assert len(table) == len(set(table)), f"{seq_id} holds a page twice"
            for idx, page in enumerate(table):
                holders[page].append((seq_id, idx))
        for page in range(self.num_pages):
            states = [page in self._evictable, page in free, self._ref[page] > 0]
            assert sum(states) == 1, f"page {page} is in {sum(states)} states (evictable, free, held)"
            assert self._ref[page] == len(holders.get(page, ())), (
                f"page {page}: ref {self._ref[page]} != {len(holders.get(page, ()))} page tables")
            if page in self._evictable:
                assert page in self._page_key, f"evictable page {page} has no key"
            if page in free:
                assert page not in self._page_key, f"free page {page} still has a key"
        for key, page in self._cached.items():
            assert self._page_key.get(page) == key, f"cache entry for page {page} disagrees"
        assert len(self._cached) == len(self._page_key)
        # Shared read-only: the page sits at the same position in every table holding it, behind the
        # same tokens (same key chain; with caching off only forks share, so the same pages).
        prefix_of = self._seq_keys if self.enable_prefix_caching else self._tables
        for page, where in holders.items():
            first_seq, idx = where[0]
            for seq_id, other_idx in where[1:]:
                assert other_idx == idx and prefix_of[seq_id][:idx] == prefix_of[first_seq][:idx], (
                    f"page {page} shared by {first_seq} and {seq_id} not as a common prefix")
        self.host.check_invariants()
        for seq_id, keys in self._seq_keys.items():
            assert len(keys) <= len(self._tables[seq_id]), f"{seq_id} has keys past its table"
            for key, page in zip(keys, self._tables[seq_id]):
                if page in self._page_key:
                    assert self._page_key[page] == key, f"{seq_id}: page {page} keyed for other tokens"
