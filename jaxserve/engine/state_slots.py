"""Recurrent-state slots on the host: which device slot (model/state_cache.py) each open sequence
of a hybrid stack holds, and the prefix cache's state snapshots. Pure Python.

A sequence takes a slot when it opens (admission, or resumption after a preemption) and returns it
when it is freed (finish, abort, preemption). A forked sample takes its own slot, which the device
fills from its parent's before the next step (`drain_copies`): the copy reads the parent's state as
every step dispatched before it left it, and the parent's next step runs after the copy.

Snapshots (prefix caching on): the state after a page boundary is what a later sequence with the
same tokens up to that boundary needs besides the pages. A prefill chunk that ends on a page
boundary (the scheduler cuts chunks there, `snapshot_length`: first where a sequence's prefix-cache
match ended past its last snapshot, so a prefix shared by many prompts is snapshotted at its end by
the second of them) also writes its end state into a
snapshot slot (the step's `state_snapshot`), keyed by the prefix key of the page that ends there
(engine/prefix_keys.py: equal keys mean equal namespace and tokens). A snapshot can be restored
from the plan after the one that writes it (`promote`): a restore is a slot copy done before its
step, so it reads what every earlier step left. Admission (`restorable`) keeps the longest cached
prefix that ends at a snapshot and restores it into the new sequence's slot; its first chunk then
starts there and reads that state. When a new snapshot needs a slot, one never restored goes first
(the oldest: most are a single prompt's tail), then the least recently restored; a snapshot whose
pages were evicted is simply never matched.
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Sequence as Seq

if TYPE_CHECKING:
    from jaxserve.core.request import Sequence
    from jaxserve.core.step_plan import ScheduledChunk


class StateSlots:
    def __init__(self, num_slots: int, num_snapshots: int = 0) -> None:
        """num_slots: running sequences' slots, 0 for a stack without linear layers (then every
        call is a no-op); num_snapshots: snapshot slots after them (0: no prefix caching)."""
        self.num_slots = num_slots
        self.num_snapshots = num_snapshots
        self._free: collections.deque[int] = collections.deque(range(num_slots))
        self.slot_of: dict[str, int] = {}          # open sequence -> its slot
        self._copies: list[tuple[int, int]] = []   # (src slot, dst slot) since the last drain
        self._snap_free: collections.deque[int] = collections.deque(range(num_slots, num_slots + num_snapshots))
        # key -> slot, oldest first: never restored (cold), restored at least once (hot, least recently first)
        self._cold: collections.OrderedDict[bytes, int] = collections.OrderedDict()
        self._hot: collections.OrderedDict[bytes, int] = collections.OrderedDict()
        self._pending: list[tuple[bytes, int]] = []  # written by the plan in flight: restorable from the next
        self.num_restored = 0                      # restores (sequences that skipped a cached prefix)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def total_slots(self) -> int:
        """Device slots in all: the running sequences' and the snapshots'."""
        return self.num_slots + self.num_snapshots

    def take(self, seq_id: str) -> None:
        if not self.num_slots:
            return
        if seq_id in self.slot_of:
            raise ValueError(f"sequence {seq_id!r} already holds state slot {self.slot_of[seq_id]}")
        if not self._free:
            raise RuntimeError(f"all {self.num_slots} recurrent-state slots are held: more sequences are open "
                               "than max_num_seqs allows")
        self.slot_of[seq_id] = self._free.popleft()

    def fork(self, parent_id: str, child_id: str) -> None:
        if not self.num_slots:
            return
        self.take(child_id)
        self._copy(self.slot_of[parent_id], self.slot_of[child_id])

    def free(self, seq_id: str) -> None:
        if self.num_slots:
            self._free.append(self.slot_of.pop(seq_id))

    def _copy(self, src: int, dst: int) -> None:
        """A copy before the next step. The step's copies all read before any writes, so a copy from a
        slot that an earlier one fills (a leader restored from a snapshot, then forked) reads that
        copy's source instead."""
        src = next((s for s, d in reversed(self._copies) if d == src), src)
        self._copies.append((src, dst))

    def drain_copies(self) -> list[tuple[int, int]]:
        """(src, dst) slot copies of the forks and restores since the last drain, for the step planned now."""
        copies, self._copies = self._copies, []
        return copies

    # ---- snapshots ---------------------------------------------------------------------------

    @staticmethod
    def snapshot_length(start: int, length: int, page_size: int, match_end: int = 0) -> int:
        """A prefill chunk [start, start + length) cut so that it ends on a page boundary (the rest
        runs in the next step): at `match_end`, where the sequence's prefix-cache match ended past
        its last snapshot (the prefix it shares with earlier prompts: the next such prompt restores
        there), else at the last boundary inside it. A chunk of one page or less is kept."""
        end = start + length
        boundary = match_end if start < match_end < end else end // page_size * page_size
        return boundary - start if start < boundary < end else length

    def restorable(self, cached: Seq[Seq[int | None]], keys: Seq[bytes]) -> list[list[int | None]]:
        """The prefix-cache match `cached` (per layer group, from match_groups) cut to its longest
        prefix of k pages whose state after page k was snapshotted (no page when none was)."""
        k = len(cached[0])
        while k and keys[k - 1] not in self._cold and keys[k - 1] not in self._hot:
            k -= 1
        return [list(pages[:k]) for pages in cached]

    def restore(self, seq_id: str, key: bytes) -> None:
        """`seq_id`'s slot takes the snapshot under `key` before the next step."""
        slot = self._cold.pop(key) if key in self._cold else self._hot.pop(key)
        self._hot[key] = slot  # the most recently restored
        self._copy(slot, self.slot_of[seq_id])
        self.num_restored += 1

    def promote(self) -> None:
        """Snapshots written by the plan dispatched last become restorable (called as a plan starts)."""
        for key, slot in self._pending:
            self._cold[key] = slot
        self._pending = []

    def register(self, chunks: Seq["ScheduledChunk"], owners: dict[str, "Sequence"], page_size: int
                 ) -> dict[str, int]:
        """Snapshot slots for the plan's chunks that end on a page boundary whose prefix key is known
        (Sequence.snapshot_keys) and not snapshotted yet: seq_id -> the slot its end state is written to."""
        out: dict[str, int] = {}
        if not self.num_snapshots:
            return out
        for chunk in chunks:
            end = chunk.start_pos + len(chunk.token_ids)
            keys = owners[chunk.seq_id].snapshot_keys
            if end % page_size or len(chunk.token_ids) == 1 or not 0 < end // page_size <= len(keys):
                continue
            key = keys[end // page_size - 1]
            if key in self._cold or key in self._hot or any(k == key for k, _ in self._pending):
                continue
            if self._snap_free:
                slot = self._snap_free.popleft()
            elif self._cold or self._hot:
                slot = (self._cold or self._hot).popitem(last=False)[1]
            else:
                break  # every snapshot slot is being written by this plan
            self._pending.append((key, slot))
            out[chunk.seq_id] = slot
        return out

    def reset(self) -> None:
        """Forgets every snapshot (the prefix cache was reset)."""
        for snapshots in (self._cold, self._hot):
            self._snap_free.extend(snapshots.values())
            snapshots.clear()
