"""The KV host tier's device side: page contents moved between the device pool and host memory.

The allocator (page_allocator.py) decides which pages move and names host pages by slot numbers;
this file holds their contents. A step's demotions (device -> host) are cut into power-of-two runs;
each run is one `gather_pages` program (W pages out of the pool, W in CHUNK_WIDTHS) whose result is
put into host memory asynchronously (`memory_kind="pinned_host"` where the backend has it; on a
CPU the pool already lives in RAM and the run stays where it is). Each host slot then refers to
(run, row). A promotion (host -> device) puts each run it reads back on the device and scatters its
rows into the pool (`scatter_pages`, the pool donated; the rows not promoted target an
out-of-bounds page and are dropped). No step waits on the host: every move is dispatched on the
device's stream ahead of the forward that reads the pages, and runs are dropped once no slot
refers to them. Power-of-two runs bound the programs to 2 x len(CHUNK_WIDTHS) (warm_page_moves
compiles them).

Host memory stays within the tier's pages (`--kv-offload-gib`): a run is held while any of its rows
is referenced, so a run of 64 pages with one live row would hold 64 pages' memory. When the rows the
held runs span exceed the tier's pages, the sparsest runs are compacted: their live rows copied on
the host into new power-of-two runs (no program, nothing compiled), the old runs dropped.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.model import kv_cache
from jaxserve.parallel import sharding

CHUNK_WIDTHS = (1, 2, 4, 8, 16, 32, 64)


@jax.jit
def gather_pages(kv: kv_cache.KVPages, src: jax.Array) -> kv_cache.KVPages:
    """The pages `src` [W] of every layer (values and scales): a KVPages of W pages."""
    return jax.tree.map(lambda pages: jnp.take(pages, src, axis=0), kv)


def _scatter(kv: kv_cache.KVPages, rows: kv_cache.KVPages, dst: jax.Array) -> kv_cache.KVPages:
    return jax.tree.map(lambda pages, r: pages.at[dst].set(r.astype(pages.dtype), mode="drop"), kv, rows)


scatter_pages = jax.jit(_scatter, donate_argnums=(0,))


def power_of_two_runs(n: int) -> list[int]:
    """n as a sum of CHUNK_WIDTHS, largest first (13 -> [8, 4, 1])."""
    out = []
    for width in reversed(CHUNK_WIDTHS):
        while n >= width:
            out.append(width)
            n -= width
    return out


class HostTier:
    def __init__(self, kv: kv_cache.KVPages, put: Callable[[np.ndarray], jax.Array], capacity: int) -> None:
        """put: places a host index array as the step inputs are placed (replicated on the mesh);
        capacity: the tier's pages (host slots), which the held runs' rows never exceed."""
        self._put = lambda a: put(np.ascontiguousarray(a, np.int32))
        device = kv.k[0].addressable_shards[0].device  # this process's (multi-host: not every device is)
        kinds = {m.kind for m in device.addressable_memories()} if device.platform != "cpu" else set()
        self._host = "pinned_host" if "pinned_host" in kinds else None
        self.memory = self._host or "the CPU's RAM, where the pool also lives"
        self._device_shardings = jax.tree.map(lambda a: a.sharding, kv)
        self.num_pages_oob = kv.num_pages  # a destination that drops its row
        self._slots: dict[int, tuple[Any, int]] = {}  # host slot -> (run, row)
        self._runs: dict[int, tuple[Any, set[int]]] = {}  # id(run) -> (run, the slots referring to it)
        self.capacity = capacity
        self.held_pages = 0  # pages' worth of host memory the held runs take (live rows and dead ones)

    def _refer(self, slot: int, run: Any, row: int) -> None:
        self._release(slot)
        self._slots[slot] = (run, row)
        if id(run) not in self._runs:
            self._runs[id(run)] = (run, set())
            self.held_pages += run.k[0].shape[0]
        self._runs[id(run)][1].add(slot)

    def _release(self, slot: int) -> tuple[Any, int] | None:
        held = self._slots.pop(slot, None)
        if held is not None:
            run, slots = self._runs[id(held[0])]
            slots.discard(slot)
            if not slots:
                del self._runs[id(run)]
                self.held_pages -= run.k[0].shape[0]
        return held

    def _compact(self) -> None:
        """Sparsest runs first: their live rows into new power-of-two runs, until the held runs fit."""
        for run, slots in sorted(self._runs.values(), key=lambda rs: len(rs[1]) / rs[0].k[0].shape[0]):
            if self.held_pages <= self.capacity:
                return
            if len(slots) == run.k[0].shape[0]:
                continue  # nothing dead in it
            live = sorted(slots, key=lambda slot: self._slots[slot][1])
            rows = np.asarray([self._slots[slot][1] for slot in live])
            start = 0
            for width in power_of_two_runs(len(live)):
                piece = jax.tree.map(lambda a: _take_rows(a, rows[start:start + width]), run)
                for row, slot in enumerate(live[start:start + width]):
                    self._refer(slot, piece, row)
                start += width

    def _to_host(self, rows: kv_cache.KVPages) -> Any:
        if self._host is None:
            return rows
        return jax.tree.map(lambda a: jax.device_put(a, a.sharding.with_memory_kind(self._host)), rows)

    def _to_device(self, run: Any) -> kv_cache.KVPages:
        if self._host is None:
            return run
        return jax.tree.map(jax.device_put, run, self._device_shardings)

    def demote(self, kv: kv_cache.KVPages, moves: np.ndarray) -> None:
        """moves: [n, 2] (device page, host slot)."""
        slots = iter(moves[:, 1])
        for run in gather_runs(kv, moves[:, 0], self._put):
            run = self._to_host(run)
            for row in range(run.k[0].shape[0]):
                self._refer(int(next(slots)), run, row)
        if self.held_pages > self.capacity:
            self._compact()

    def promote(self, kv: kv_cache.KVPages, moves: np.ndarray) -> kv_cache.KVPages:
        """moves: [n, 2] (host slot, device page). Returns the pool (donated and replaced)."""
        by_run: dict[int, tuple[Any, np.ndarray]] = {}
        for slot, page in moves:
            run, row = self._release(int(slot))
            if id(run) not in by_run:
                by_run[id(run)] = (run, np.full(run.k[0].shape[0], self.num_pages_oob, np.int32))
            by_run[id(run)][1][row] = page
        for run, dst in by_run.values():
            kv = scatter_pages(kv, self._to_device(run), self._put(dst))
        return kv


def _take_rows(a: jax.Array, rows: np.ndarray) -> jax.Array:
    """Rows `rows` of a run's leaf [W, ...] as a new array placed as `a` is (same devices, same
    memory kind), copied shard by shard on the host: no program runs, so nothing compiles."""
    shards = [jax.device_put(np.asarray(shard.data)[rows], shard.data.sharding) for shard in a.addressable_shards]
    return jax.make_array_from_single_device_arrays((len(rows), *a.shape[1:]), a.sharding, shards)


def gather_runs(kv: kv_cache.KVPages, pages: Sequence[int] | np.ndarray,
                put: Callable[[np.ndarray], jax.Array]) -> list[kv_cache.KVPages]:
    """The pages `pages` in power-of-two runs (a KVPages of W pages each, on the pool's devices)."""
    runs, start = [], 0
    for width in power_of_two_runs(len(pages)):
        runs.append(gather_pages(kv, put(np.asarray(pages[start:start + width], np.int32))))
        start += width
    return runs


def scatter_runs(kv: kv_cache.KVPages, runs: list[kv_cache.KVPages], dst: Sequence[int],
                 put: Callable[[np.ndarray], jax.Array]) -> kv_cache.KVPages:
    """Writes the runs' rows into pages `dst` (one per row, in order; an out-of-bounds page drops
    its row). Returns the pool (donated and replaced)."""
    start = 0
    for run in runs:
        width = run.k[0].shape[0]
        kv = scatter_pages(kv, run, put(np.asarray(dst[start:start + width], np.int32)))
        start += width
    return kv


def read_pages(kv: kv_cache.KVPages, pages: list[int], put: Callable[[np.ndarray], jax.Array]) -> list[np.ndarray]:
    """The K/V of `pages` on the host, one array per pool leaf (jax.tree.leaves order) [n, ...].
    Waits for the device: for a KV export (PD disaggregation), not for a step."""
    leaves = [jax.tree.leaves(run) for run in jax.device_get(gather_runs(kv, pages, put))]
    return [np.concatenate([run[j] for run in leaves]) for j in range(len(leaves[0]))] if leaves else []


def write_pages(kv: kv_cache.KVPages, pages: list[int], leaves: list[np.ndarray],
                put: Callable[[np.ndarray], jax.Array]) -> kv_cache.KVPages:
    """Fills device `pages` with host K/V (`leaves` as read_pages gives them, one row per page),
    placed as the pool is; put places the index arrays. Returns the pool (donated and replaced)."""
    shardings = jax.tree.map(lambda a: a.sharding, kv)
    treedef = jax.tree.structure(kv)
    runs, start = [], 0
    for width in power_of_two_runs(len(pages)):
        rows = jax.tree.unflatten(treedef, [np.ascontiguousarray(leaf[start:start + width]) for leaf in leaves])
        runs.append(sharding.put(rows, shardings))
        start += width
    return scatter_runs(kv, runs, pages, put)


def warm_page_moves(kv: kv_cache.KVPages, put: Callable[[np.ndarray], jax.Array]) -> kv_cache.KVPages:
    """Compiles every run width's gather and scatter (moving nothing). Returns the pool."""
    oob = kv.num_pages
    for width in CHUNK_WIDTHS:
        run = gather_pages(kv, put(np.zeros(width, np.int32)))
        kv = scatter_pages(kv, run, put(np.full(width, oob, np.int32)))
    return kv
