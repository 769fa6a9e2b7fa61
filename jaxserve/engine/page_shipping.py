"""Shipping cached pages between engines (prefill/decode disaggregation), the allocator's half:
which device pages hold a prompt's prefix, laid out group by group, and keying pages that arrive.

Rows of a prefix of n full pages: layer group 0's n pages, then each further group's from the
first page its window reads at position n x page_size (kv_groups.py): `export_rows(n)` of them.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq


class ShippedPages:
    """Mixed into PageAllocator: reads and writes its cache, free list and LRU."""

    def export_rows(self, num_pages: int) -> int:
        """Pages shipped for a prefix of `num_pages` full pages: every group's that its window reads."""
        end = num_pages * self.page_size
        return sum(num_pages - self.first_needed_page(g, end) for g in range(self.num_groups))

    def prefix_of_rows(self, rows: int) -> int:
        """The prefix's full pages that `rows` shipped pages hold (export_rows' inverse); ValueError
        when no prefix ships that many."""
        if rows > self.num_pages:
            raise ValueError(f"{rows} pages do not fit a pool of {self.num_pages}")
        n = 0
        while self.export_rows(n) < rows:
            n += 1
        if self.export_rows(n) != rows:
            raise ValueError(f"{rows} pages are no whole prefix of this model's layer groups")
        return n

    def device_prefix(self, token_ids: Seq[int], namespace: str) -> list[int]:
        """The device pages caching `token_ids`' longest cached prefix of full pages (a host hit
        ends it): what a prefill instance exports (every full page, the last token's included).
        Rows in group order, each group's from the first page its window reads (export_rows)."""
        keys = self._chain(token_ids, namespace, len(token_ids) // self.page_size)
        cached, _ = self.match_groups(keys, host=False)
        return [p for pages in cached for p in pages if p is not None]

    def import_pages(self, token_ids: Seq[int], namespace: str, num_pages: int) -> list[tuple[int, int]]:
        """Caches the first `num_pages` full pages of `token_ids` whose K/V arrives from elsewhere (a
        prefill instance; rows laid out as `device_prefix` gives them): each row not cached yet gets
        a fresh device page, keyed and evictable. Returns (row, device page) for the pages the caller
        must fill before any step reads them; none when the pool cannot take them all."""
        if not self.enable_prefix_caching:
            return []
        keys = self._chain(token_ids, namespace, num_pages)
        todo, row = [], 0
        for g in range(self.num_groups):
            for i in range(self.first_needed_page(g, num_pages * self.page_size), num_pages):
                gkey = self._group_key(g, keys[i])
                if gkey not in self._cached:
                    todo.append((row, gkey))
                row += 1
        if len(todo) > self.num_free_pages:
            return []
        out = []
        for row, gkey in todo:
            page = self._pop_fresh()
            self._ref[page] = 0
            self._cached[gkey] = page
            self._page_key[page] = gkey
            self._evictable[page] = None
            out.append((row, page))
        return out
