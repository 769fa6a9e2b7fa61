"""Which adapter sits in each of the N device slots (host, pure Python; the scheduler owns it).

A sequence holds (pins) its adapter's slot from admission until it finishes or is preempted; an
adapter not in a slot takes a free slot, else the least recently used unpinned one, and the step
that admits its first sequence loads it there first (StepPlan.lora_loads). With every slot pinned
by other adapters the request waits at the head of the queue like one waiting for KV pages.
Device steps run in order, so a slot is rewritten only after every dispatched step that read it.
"""

from __future__ import annotations


class SlotTable:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"max_loras must be >= 1, got {num_slots}")
        self.names: list[str | None] = [None] * num_slots
        self.pins = [0] * num_slots
        self._used = [0] * num_slots   # clock of the last acquire (LRU)
        self._clock = 0
        self.num_loads = 0

    def available(self, name: str) -> bool:
        """Whether `acquire(name)` would succeed now."""
        return name in self.names or any(p == 0 for p in self.pins)

    def acquire(self, name: str) -> tuple[int, bool]:
        """Pins `name`'s slot for one sequence: (slot, whether it must be loaded first). Raises
        RuntimeError when every slot is pinned by another adapter (check `available` first)."""
        self._clock += 1
        if name in self.names:
            slot, load = self.names.index(name), False
        else:
            free = [i for i, p in enumerate(self.pins) if p == 0]
            if not free:
                raise RuntimeError(f"no LoRA slot for {name!r}: all {len(self.names)} are in use")
            slot = min(free, key=lambda i: (self.names[i] is not None, self._used[i]))  # empty first, then LRU
            self.names[slot], load = name, True
            self.num_loads += 1
        self.pins[slot] += 1
        self._used[slot] = self._clock
        return slot, load

    def forget(self, name: str) -> None:
        """An unloaded adapter leaves its slot (unpinned by then), so a later adapter of the same
        name is loaded afresh."""
        if name in self.names:
            slot = self.names.index(name)
            if self.pins[slot]:
                raise RuntimeError(f"LoRA adapter {name!r} is unloaded while {self.pins[slot]} sequence(s) hold it")
            self.names[slot] = None

    def release(self, slot: int) -> None:
        if self.pins[slot] <= 0:
            raise RuntimeError(f"LoRA slot {slot} released more often than acquired")
        self.pins[slot] -= 1
