"""Prefix-cache lookups, the allocator's read-only half: the key chain of a prompt's full pages and
the longest prefix that every KV layer group can resume from.

A full-attention group resumes only where each page before is cached; a sliding group only where
the pages its window still reads are (kv_groups.py), so a hit after the window has moved on needs
few of a sliding group's pages. A page found only in the host tier is listed as `host_page(index)`.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

from jaxserve.engine.prefix_keys import host_page, namespace_key, page_key


class PrefixMatch:
    """Mixed into PageAllocator: reads its cache and host tier index."""

    def prefix_keys(self, token_ids: Seq[int], namespace: str) -> list[bytes]:
        """The prefix-cache keys of the full pages of `token_ids` before its last token (what
        `match_prefix` looks up); a caller may keep them while the tokens do not change."""
        if not self.enable_prefix_caching or len(token_ids) < 2:
            return []
        return self._chain(token_ids, namespace, (len(token_ids) - 1) // self.page_size)

    def _chain(self, token_ids: Seq[int], namespace: str, num_pages: int) -> list[bytes]:
        ps, key, keys = self.page_size, namespace_key(namespace), []
        for i in range(num_pages):
            key = page_key(key, token_ids[i * ps:(i + 1) * ps])
            keys.append(key)
        return keys

    def match_prefix(self, token_ids: Seq[int], namespace: str) -> tuple[list[int], int]:
        """Longest run of cached full pages that prefixes `token_ids` in `namespace` (a stack of
        one layer group; `match_groups` for any).

        Never covers the last token: it must be computed so the step has logits to sample from.
        Pure lookup: takes no references and counts nothing (see `open`). A page found only in the
        host tier is listed as `host_page(index)` (negative).
        """
        return self.match_keys(self.prefix_keys(token_ids, namespace))

    def match_keys(self, keys: Seq[bytes]) -> tuple[list[int], int]:
        """match_prefix for tokens whose `prefix_keys` the caller kept (no hashing)."""
        if self.num_groups != 1 or self.has_windows:
            raise ValueError("a stack with sliding layer groups matches with match_groups")
        cached, n = self.match_groups(keys)
        return cached[0], n

    def match_groups(self, keys: Seq[bytes], host: bool = True) -> tuple[list[list[int | None]], int]:
        """The longest prefix of `keys` (prefix_keys) that every layer group can resume from: a full
        group needs each of its pages cached, a sliding group the ones its window still reads.
        Returns (per group its pages, None where the window no longer reads; the tokens covered).
        host: host-tier hits count (as `host_page(index)`)."""
        n = len(keys)
        found: list[list[int | None]] = []
        for g in range(self.num_groups):
            pages: list[int | None] = []
            for key in keys[:n]:
                page = self._lookup(self._group_key(g, key), host)
                if page is None and self.windows[g] is None:
                    break
                pages.append(page)
            n = min(n, len(pages)) if self.windows[g] is None else n
            found.append(pages)
        while n > 0 and not all(all(p is not None for p in found[g][self.first_needed_page(g, n * self.page_size):n])
                                for g in range(self.num_groups)):
            n -= 1  # a sliding group misses a page its window reads: a shorter prefix
        out = []
        for g, pages in enumerate(found):
            lo = self.first_needed_page(g, n * self.page_size)
            out.append([None] * lo + pages[lo:n])
        return out, n * self.page_size

    def _lookup(self, key: bytes, host: bool) -> int | None:
        page = self._cached.get(key)
        if page is None and host:
            index = self.host.lookup(key)
            page = None if index is None else host_page(index)
        return page

    @staticmethod
    def _group_key(group: int, key: bytes) -> bytes:
        """Group g's prefix-cache key of a page: the chain's key, tagged past the first group."""
        return key if group == 0 else key + group.to_bytes(2, "little")
