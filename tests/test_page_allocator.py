"""PageAllocator: page tables, ref counts, prefix cache (hash chain, namespaces, LRU), fork + COW."""

import pytest

from jaxserve.engine.page_allocator import NoFreePagesError, PageAllocator

NS = "model\x00"


def make(num_pages: int = 8, page_size: int = 4, caching: bool = True) -> PageAllocator:
    return PageAllocator(num_pages, page_size, enable_prefix_caching=caching)


def computed(alloc: PageAllocator, seq_id: str, tokens: list[int], ns: str = NS) -> list[int]:
    """Opens seq_id, gives it pages for `tokens`, marks them computed; returns its page table."""
    alloc.open(seq_id, ns)
    alloc.grow(seq_id, len(tokens), 0)
    alloc.commit(seq_id, tokens)
    alloc.check_invariants()
    return list(alloc.page_table(seq_id))


def test_bad_sizes_raise():
    with pytest.raises(ValueError, match="num_pages"):
        PageAllocator(0, 16)
    with pytest.raises(ValueError, match="page_size"):
        PageAllocator(4, 0)


def test_pages_grow_with_the_sequence_and_return_on_free():
    alloc = make(num_pages=8, page_size=4)
    assert alloc.pages_needed(0) == 0 and alloc.pages_needed(4) == 1 and alloc.pages_needed(5) == 2
    alloc.open("a", NS)
    assert alloc.grow("a", 3, 0) == []
    assert len(alloc.page_table("a")) == 1
    alloc.grow("a", 4, 3)
    assert len(alloc.page_table("a")) == 1  # still fits the first page
    alloc.grow("a", 9, 4)
    table = alloc.page_table("a")
    assert len(table) == 3 and len(set(table)) == 3
    assert alloc.num_free_pages == 5 and all(alloc.ref_count(p) == 1 for p in table)
    assert alloc.can_allocate(5) and not alloc.can_allocate(6)
    alloc.check_invariants()
    alloc.free("a")
    assert alloc.num_free_pages == 8 and not alloc.has_sequence("a")
    alloc.check_invariants()


def test_grow_past_the_pool_raises_and_changes_nothing():
    alloc = make(num_pages=2, page_size=4)
    alloc.open("a", NS)
    alloc.grow("a", 4, 0)
    with pytest.raises(NoFreePagesError):
        alloc.grow("a", 13, 4)  # needs 3 more pages, 1 free
    assert len(alloc.page_table("a")) == 1 and alloc.num_free_pages == 1
    alloc.check_invariants()


def test_prefix_hit_reuses_pages_and_never_covers_the_last_token():
    alloc = make(num_pages=8, page_size=4)
    tokens = list(range(100, 112))  # 3 full pages
    table = computed(alloc, "a", tokens)
    alloc.free("a")
    assert alloc.num_evictable_pages == 3 and alloc.num_free_pages == 8
    pages, n = alloc.match_prefix(tokens, NS)
    assert (pages, n) == (table[:2], 8)  # the third page holds the last token: it is recomputed
    pages, n = alloc.match_prefix(tokens + [7], NS)
    assert (pages, n) == (table, 12)
    pages, n = alloc.match_prefix(tokens[:4] + [0] + tokens[5:] + [7], NS)
    assert (pages, n) == (table[:1], 4)  # a changed token breaks the chain from its page on
    assert alloc.match_prefix([5, 6, 7, 8, 9], NS) == ([], 0)

    pages, n = alloc.match_prefix(tokens + [7], NS)
    assert alloc.can_allocate(5, holding=pages) and not alloc.can_allocate(6, holding=pages)
    alloc.open("b", NS, pages, num_query_tokens=13)
    assert alloc.page_table("b") == table and alloc.num_evictable_pages == 0
    assert alloc.stats.queries == 13 and alloc.stats.hits == 12
    alloc.check_invariants()


def test_shared_prefix_pages_are_counted_once_per_holder():
    alloc = make(num_pages=8, page_size=4)
    tokens = list(range(8))
    table = computed(alloc, "a", tokens)  # a keeps running
    pages, n = alloc.match_prefix(tokens + [9, 9], NS)
    alloc.open("b", NS, pages)
    alloc.grow("b", 10, 8)
    assert [alloc.ref_count(p) for p in table] == [2, 2]
    alloc.check_invariants()
    alloc.free("b")  # the shared pages stay with a
    assert [alloc.ref_count(p) for p in table] == [1, 1] and alloc.page_table("a") == table
    alloc.check_invariants()


def test_different_namespaces_never_share():
    alloc = make(num_pages=8, page_size=4)
    tokens = list(range(9))
    computed(alloc, "a", tokens, ns="model\x00\x01tenant-a")
    alloc.free("a")
    assert alloc.match_prefix(tokens, "model\x00\x01tenant-b") == ([], 0)
    assert alloc.match_prefix(tokens, "model\x00") == ([], 0)
    assert alloc.match_prefix(tokens, "other-model\x00\x01tenant-a") == ([], 0)
    assert alloc.match_prefix(tokens, "model\x00\x01tenant-a")[1] == 8


def test_lru_evicts_the_oldest_released_pages_tail_first():
    alloc = make(num_pages=4, page_size=2)
    old = computed(alloc, "old", [1, 2, 3, 4])
    alloc.free("old")
    new = computed(alloc, "new", [5, 6, 7, 8])
    alloc.free("new")
    assert alloc.num_evictable_pages == 4 and alloc.num_free_pages == 4
    alloc.open("x", NS)
    alloc.grow("x", 2, 0)  # one page: evicts the old sequence's tail page
    assert alloc.page_table("x") == [old[1]]
    assert alloc.match_prefix([1, 2, 3, 4, 0], NS) == ([old[0]], 2)
    alloc.grow("x", 4, 2)  # then its head
    assert alloc.match_prefix([1, 2, 3, 4, 0], NS) == ([], 0)
    assert alloc.match_prefix([5, 6, 7, 8, 0], NS) == (new, 4)  # the newer one survives
    alloc.check_invariants()


def test_free_pages_are_used_before_evicting_cached_ones():
    alloc = make(num_pages=4, page_size=2)
    cached = computed(alloc, "a", [1, 2])
    alloc.free("a")
    alloc.open("b", NS)
    alloc.grow("b", 6, 0)  # 3 pages: exactly the free ones
    assert cached[0] not in alloc.page_table("b")
    assert alloc.match_prefix([1, 2, 3], NS) == (cached, 2)


def test_duplicate_content_stays_private_and_is_freed_plainly():
    alloc = make(num_pages=4, page_size=2)
    a = computed(alloc, "a", [1, 2, 3])
    b = computed(alloc, "b", [1, 2, 3])  # computed side by side: same key, other page
    assert a[0] != b[0]
    alloc.free("b")
    assert alloc.num_evictable_pages == 0  # b's copy was never entered in the cache
    alloc.free("a")
    assert alloc.num_evictable_pages == 1 and alloc.match_prefix([1, 2, 3], NS) == ([a[0]], 2)
    alloc.check_invariants()


def test_fork_shares_pages_and_copies_the_partial_page_on_write():
    alloc = make(num_pages=8, page_size=4)
    parent = computed(alloc, "p", [1, 2, 3, 4, 5, 6])  # one full page + a half-filled one
    alloc.fork("p", "c")
    assert alloc.page_table("c") == parent and [alloc.ref_count(p) for p in parent] == [2, 2]
    alloc.check_invariants()
    assert alloc.pages_to_grow("p", 7, 6) == 1
    copies = alloc.grow("p", 7, 6)  # p writes position 6, inside the shared page
    new_last = alloc.page_table("p")[1]
    assert copies == [(parent[1], new_last)] and new_last != parent[1]
    assert alloc.page_table("p")[0] == parent[0]  # full page stays shared
    assert alloc.grow("c", 7, 6) == []  # c is now the only holder: writes in place
    assert alloc.page_table("c") == parent
    assert [alloc.ref_count(p) for p in parent] == [2, 1]
    alloc.check_invariants()
    alloc.free("p")
    alloc.free("c")
    assert alloc.num_free_pages == 8
    alloc.check_invariants()


def test_disabled_caching_keeps_nothing():
    alloc = make(caching=False)
    computed(alloc, "a", list(range(9)))
    alloc.free("a")
    assert alloc.num_evictable_pages == 0 and alloc.match_prefix(list(range(9)), NS) == ([], 0)


def test_reset_prefix_cache_frees_evictable_pages():
    alloc = make(num_pages=4, page_size=2)
    computed(alloc, "a", [1, 2, 3, 4])
    alloc.free("a")
    assert alloc.reset_prefix_cache() == 2
    assert alloc.num_evictable_pages == 0 and alloc.match_prefix([1, 2, 3], NS) == ([], 0)
    alloc.check_invariants()


def test_check_invariants_catches_a_broken_ref_count():
    alloc = make()
    computed(alloc, "a", [1, 2, 3])
    alloc._ref[alloc.page_table("a")[0]] += 1  # corrupt on purpose
    with pytest.raises(AssertionError, match="ref"):
        alloc.check_invariants()


def test_check_invariants_catches_a_page_shared_outside_a_prefix():
    alloc = make()
    computed(alloc, "a", [1, 2, 3, 4, 5])
    alloc.open("b", NS)
    alloc.grow("b", 8, 0)
    page, own = alloc.page_table("a")[1], alloc.page_table("b")[0]
    alloc.page_table("b")[0] = page  # b "holds" a's second page as its first (ref counts kept right)
    alloc._ref[page] += 1
    alloc._ref[own] = 0
    alloc._free.append(own)
    with pytest.raises(AssertionError, match="common prefix"):
        alloc.check_invariants()
