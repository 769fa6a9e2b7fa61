"""The adapter slot table: an adapter in a slot is reused without a load, a new one takes an empty
slot, then the least recently used unpinned one; a pinned slot is never taken."""

import pytest

from jaxserve.lora.slot_table import SlotTable


def test_reuse_empty_first_then_lru_and_pins_block():
    t = SlotTable(2)
    assert t.acquire("a") == (0, True) and t.acquire("a") == (0, False)      # second sequence of a: no load
    assert t.acquire("b") == (1, True)                                         # the empty slot
    assert not t.available("c")                                                # both pinned
    with pytest.raises(RuntimeError, match="all 2 are in use"):
        t.acquire("c")
    t.release(1)                                                               # b done
    assert t.available("c") and t.acquire("c") == (1, True)                   # b evicted
    t.release(0), t.release(0), t.release(1)
    t.acquire("a"), t.release(0)                                               # a used after c
    assert t.acquire("d") == (1, True)                                         # c is least recent
    assert t.num_loads == 4 and t.names == ["a", "d"]
    with pytest.raises(RuntimeError, match="released more often"):
        t.release(0)
