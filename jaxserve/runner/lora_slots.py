"""The adapters' device slots (owned by the ModelRunner, device state like it) and their host copies.

Under tensor parallelism a slot's factors are split like the weight they modify (`abstract`):
the output dims of b for q/k/v/gate/up (heads, mlp), the input dims of a for o/down, the slot and
rank axes never, so each device multiplies its own shard and the sums meet where the base
projection's do.

Every `--lora-modules` adapter is read and checked at start-up, so a bad one fails the start with
its problem named; at most `max_cpu_loras` stay in host memory (LRU), the rest are read from disk
again when a slot needs them. `load(slot, name)` writes one adapter's factors into one slot of the
resident [*, N, R] arrays with a jitted update (donated: no copy of the other slots; the slot index
is data, so any slot and any adapter reuse one compiled program).
"""

from __future__ import annotations

import collections
import dataclasses
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.parallel import sharding
from jaxserve.core.config import EngineConfig, ModelConfig
from jaxserve.lora.adapter import LOGICAL_AXES, MODULES, LoraAdapter, load_adapter, shapes
from jaxserve.lora.slots import empty_slots, put as put_adapter
from jaxserve.model import weights as weights_mod


def abstract(model_cfg: ModelConfig, engine_cfg: EngineConfig, dtype: Any,
             placement: sharding.Placement) -> list[dict[str, tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]]]:
    """The slots' declaration, as the KV pool's and the weights': per layer, module -> (a [*in, N, R],
    b [N, R, *out]) as ShapeDtypeStructs placed by `placement`. Allocation (DeviceSlots), the programs'
    lowering and the memory plans (their bytes per device) all read it."""
    mesh, rules = placement
    resolved = sharding.rules_for(weights_mod.logical_dims(model_cfg), mesh, rules)
    dims, n, r = shapes(model_cfg), engine_cfg.max_loras, engine_cfg.max_lora_rank
    layer = {}
    for m in MODULES:
        (ins, outs), (in_dims, out_dims) = LOGICAL_AXES[m], dims[m]
        a_shape, b_shape = (*in_dims, n, r), (n, r, *out_dims)
        layer[m] = (jax.ShapeDtypeStruct(a_shape, dtype, sharding=sharding.named(mesh, *ins, None, None,
                                                                                  rules=resolved, shape=a_shape)),
                    jax.ShapeDtypeStruct(b_shape, dtype, sharding=sharding.named(mesh, None, None, *outs,
                                                                                  rules=resolved, shape=b_shape)))
    return [layer] * model_cfg.num_layers


def _write_slot(slots: list, slot: jax.Array, one: list) -> list:
    """slots: per layer module -> (a [*in, N, R], b [N, R, *out]); one: the same with N = 1."""
    def write(pair, new):
        a, b = pair
        na, nb = new
        a = jax.lax.dynamic_update_slice_in_dim(a, na.astype(a.dtype), slot, axis=a.ndim - 2)
        b = jax.lax.dynamic_update_slice_in_dim(b, nb.astype(b.dtype), slot, axis=0)
        return a, b

    return [{m: write(layer[m], new[m]) for m in layer} for layer, new in zip(slots, one)]


_write_slot_step = jax.jit(_write_slot, donate_argnums=(0,))


class DeviceSlots:
    def __init__(self, model_cfg: ModelConfig, engine_cfg: EngineConfig, dtype: Any, placement: sharding.Placement,
                 put: Callable[[Any], Any], checkpoint_cfg: ModelConfig | None = None) -> None:
        """model_cfg: the served model (KV heads possibly duplicated over a wide model axis:
        model/kv_heads.py); checkpoint_cfg: the model as stored, which adapters are checked against
        (their K/V factors are then repeated like the K/V projections); put: places host arrays
        replicated on the mesh (the one-slot updates)."""
        self.model_cfg = model_cfg
        self.checkpoint_cfg = checkpoint_cfg or model_cfg
        self._kv_repeat = model_cfg.num_kv_heads // self.checkpoint_cfg.num_kv_heads
        self.max_rank = engine_cfg.max_lora_rank
        self.paths = dict(engine_cfg.lora_modules)
        self._put = put
        self._host: collections.OrderedDict[str, LoraAdapter] = collections.OrderedDict()
        self._host_limit = engine_cfg.max_cpu_loras or engine_cfg.max_loras
        self._reading: dict[str, Future[LoraAdapter]] = {}  # adapter -> its read on the worker thread
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="jaxserve-lora-read")
        self.adapters = {}  # name -> (rank, modules): what each registered adapter is, for logs and listings
        for name, path in self.paths.items():
            adapter = self._read(name)
            self.adapters[name] = (adapter.rank, adapter.modules)
        self.arrays = sharding.zeros(abstract(model_cfg, engine_cfg, dtype, placement))
        self.num_loads = 0

    def register(self, name: str, path: str) -> None:
        """Adds an adapter at run time (checked by the caller with load_adapter; any thread: only
        plain dict updates here, the engine thread reads it into host memory when a slot needs it)."""
        adapter = load_adapter(path, self.checkpoint_cfg, self.max_rank, name)
        self.adapters[name] = (adapter.rank, adapter.modules)
        self.paths[name] = path

    def unregister(self, name: str) -> None:
        """Removes an adapter no request uses (the caller checked); its host copy goes with it."""
        del self.paths[name]
        del self.adapters[name]

    def _read(self, name: str) -> LoraAdapter:
        """Engine thread: the adapter's host copy, read from disk here only when `resident` did not
        bring it in first."""
        adapter = self._host.get(name)
        if adapter is None:
            adapter = self._keep(name, self._read_disk(name))
        self._host.move_to_end(name)
        return adapter

    def _read_disk(self, name: str) -> LoraAdapter:
        adapter = load_adapter(self.paths[name], self.checkpoint_cfg, self.max_rank, name)
        if self._kv_repeat > 1:  # b [r, Hkv, hd] of k/v: each KV head repeated as the projections are
            adapter = dataclasses.replace(adapter, factors={
                key: (a, np.repeat(b, self._kv_repeat, axis=1) if key[1] in ("k_proj", "v_proj") else b)
                for key, (a, b) in adapter.factors.items()})
        return adapter

    def _keep(self, name: str, adapter: LoraAdapter) -> LoraAdapter:
        self._host[name] = adapter
        while len(self._host) > self._host_limit:
            self._host.popitem(last=False)
        return adapter

    def resident(self, name: str) -> bool:
        """Engine thread, at admission: whether `name` can go into a device slot without a disk
        read. If not, its read starts on a worker thread (False until it is done), so the steps
        of the running sequences never wait for a disk; the request is admitted once it is in."""
        if name in self._host:
            return True
        reading = self._reading.get(name)
        if reading is None:
            self._reading[name] = self._reader.submit(self._read_disk, name)
            return False
        if not reading.done():
            return False
        del self._reading[name]
        self._keep(name, reading.result())  # a failed read raises here, as a read in the step did
        return True

    def load(self, slot: int, name: str) -> None:
        """Writes adapter `name` into device slot `slot` (ordered after every step dispatched before)."""
        one = empty_slots(self.model_cfg, 1, self.max_rank)
        put_adapter(one, 0, self._read(name))
        self.arrays = _write_slot_step(self.arrays, jnp.int32(slot), self._put(one))
        self.num_loads += 1

    def warmup(self) -> None:
        """Compiles the slot write (an empty adapter into slot 0, which holds nothing yet)."""
        one = empty_slots(self.model_cfg, 1, self.max_rank)
        self.arrays = _write_slot_step(self.arrays, jnp.int32(0), self._put(one))
        jax.block_until_ready(self.arrays)

