"""Owns the weights, the KV pages and the mesh; compiles every declared bucket; runs steps.

A step is two jitted programs dispatched back to back without a host sync:
  forward (bucket T x S): embed -> layers over the donated KV pages -> logits for the S sample rows
  sample  (bucket S x H): penalties/temperature/top-k/top-p/min-p -> token ids, logprobs
Splitting them keeps the compiled-program count additive (|T x S| + |S x H|) instead of
multiplicative, while the KV pool still never leaves the device and is never copied.

The sample program also pads the sampled ids into a fixed `[max rows]` device buffer that the next
step's forward reads for its in-flight decodes (async scheduling: `StepArrays.prev_sample_row`), so
the next step can be dispatched before this one's ids reach the host.

Compilation is counted through jax.monitoring: after `warmup()` every new compilation is logged
as an error and counted in `compilations_after_warmup` (a metric and a test assertion).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxserve import kv_cache, sharding
from jaxserve.buckets import history_buckets
from jaxserve.capacity import plan_capacity
from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.machine import machine_info
from jaxserve.model.attention import make_attention
from jaxserve.model.paged import forward_paged
from jaxserve.model.weights import Weights
from jaxserve.packing import PackSpec, pack, unpack
from jaxserve.sampler import SamplerOutput, SamplingTensors, sample
from jaxserve.step_inputs import StepArrays, StepInputBuilder, StepInputs

logger = logging.getLogger("jaxserve.model_runner")

_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class CompileCounter:
    """Counts XLA backend compilations process-wide (jax.monitoring has no unregister, so one
    listener is installed once and runners read deltas)."""

    _lock = threading.Lock()
    _count = 0
    _installed = False

    @classmethod
    def install(cls) -> None:
        with cls._lock:
            if not cls._installed:
                def on_event(event: str, duration: float, **kwargs: Any) -> None:
                    if event == _COMPILE_EVENT:
                        with cls._lock:
                            cls._count += 1
                jax.monitoring.register_event_duration_secs_listener(on_event)
                cls._installed = True

    @classmethod
    def count(cls) -> int:
        return cls._count


# Module-level jits: runners of the same model config share compiled programs (the cache key is
# the static config plus the input shapes and shardings), so a second engine on the same model
# and buckets starts without compiling.
# Step inputs arrive packed in one int32 buffer (jaxserve/packing.py): one transfer per program.
def _forward_packed(weights: Weights, kv: kv_cache.KVPages, packed: jax.Array, spec: PackSpec, cfg: ModelConfig,
                    attention_fn: Callable[..., jax.Array], prev_ids: jax.Array
                    ) -> tuple[jax.Array, kv_cache.KVPages]:
    return forward_paged(weights, cfg, kv, unpack(packed, spec), attention_fn, prev_ids)


_forward_step = jax.jit(_forward_packed, static_argnames=("spec", "cfg", "attention_fn"), donate_argnames=("kv",))


def _sample_and_keep(logits: jax.Array, packed: jax.Array, spec: PackSpec, vocab_size: int,
                     width: int) -> tuple[SamplerOutput, jax.Array]:
    """sample(), plus its token ids padded to [width] for the next step's forward (prev_ids)."""
    out = sample(logits, unpack(packed, spec), vocab_size)
    return out, jnp.pad(out.token_ids, (0, width - out.token_ids.shape[0]))


_sample_step = jax.jit(_sample_and_keep, static_argnames=("spec", "vocab_size", "width"))
_copy_step = jax.jit(kv_cache.copy_pages, donate_argnums=(0,))


class ModelRunner:
    def __init__(self, model_cfg: ModelConfig, weights: Weights, engine_cfg: EngineConfig, mesh: Mesh,
                 dtype: Any = jnp.float32) -> None:
        CompileCounter.install()
        self.model_cfg = model_cfg
        self.mesh = mesh
        self.weights = weights
        self.dtype = jnp.dtype(dtype)
        # Unset sizes (pool, batch limits, context, buckets) come from the machine and the model.
        self.capacity = plan_capacity(engine_cfg, model_cfg, machine_info(mesh), self.dtype.itemsize,
                                      mesh.shape[sharding.MODEL_AXIS])
        for line in self.capacity.lines:
            logger.info("%s", line)
        self.engine_cfg = engine_cfg = self.capacity.engine
        num_pages = engine_cfg.num_kv_pages
        self.kv = kv_cache.allocate(model_cfg, num_pages, engine_cfg.page_size, self.dtype, mesh)
        self.num_pages = num_pages
        self.builder = StepInputBuilder(engine_cfg, num_pages, model_cfg.vocab_size)
        self.history_buckets = history_buckets(engine_cfg.max_model_len, model_cfg.vocab_size)
        self._replicated = sharding.replicated(mesh)
        self._attention = make_attention(engine_cfg.attention_backend, model_cfg, mesh)
        self._rows_width = max(s for _, s in self.builder.buckets)  # the largest sampler row bucket
        # [rows_width] int32: the last dispatched step's sampled ids, on the device
        self._prev_ids = self._put(np.zeros(self._rows_width, np.int32))
        self.warmed_up = False
        self.compilations_after_warmup = 0

    # -- steps ---------------------------------------------------------------------------------

    def _put(self, tree: Any) -> Any:
        return jax.device_put(tree, self._replicated)

    def step(self, inputs: StepInputs) -> SamplerOutput:
        """Dispatches one step; returns device arrays (no host sync). Call `fetch` for numpy."""
        before = CompileCounter.count()
        if len(inputs.copies):
            self.kv = _copy_step(self.kv, *self._put(self._pad_copies(inputs.copies)))
        logits, self.kv = self._forward(inputs.arrays)
        out, self._prev_ids = self._sample(logits, inputs.sampling)
        for leaf in out:
            leaf.copy_to_host_async()
        if self.warmed_up and CompileCounter.count() != before:
            new = CompileCounter.count() - before
            self.compilations_after_warmup += new
            logger.error("%d compilation(s) after warm-up for step shape T=%d S=%d H=%d: a bucket is "
                         "missing from warm-up", new, inputs.arrays.token_ids.shape[0],
                         inputs.arrays.seq_lens.shape[0], inputs.sampling.table_ids.shape[1])
        return out

    def _forward_args(self, arrays: StepArrays) -> dict[str, Any]:
        packed, spec = pack(arrays)
        return dict(kv=self.kv, packed=self._put(packed), spec=spec, cfg=self.model_cfg,
                    attention_fn=self._attention, prev_ids=self._prev_ids)

    def _forward(self, arrays: StepArrays) -> tuple[jax.Array, kv_cache.KVPages]:
        return _forward_step(self.weights, **self._forward_args(arrays))

    def compiled_forward(self, arrays: StepArrays) -> jax.stages.Compiled:
        """The compiled forward program for this step shape (for memory and HLO inspection)."""
        return _forward_step.lower(self.weights, **self._forward_args(arrays)).compile()

    def _sample(self, logits: jax.Array, tensors: SamplingTensors) -> tuple[SamplerOutput, jax.Array]:
        packed, spec = pack(tensors)
        return _sample_step(logits, self._put(packed), spec=spec, vocab_size=self.model_cfg.vocab_size,
                            width=self._rows_width)

    def compiled_sampler(self, rows: int, width: int) -> jax.stages.Compiled:
        """The compiled sampler for `rows` rows and history width `width` (for memory inspection)."""
        packed, spec = pack(_dummy_sampling(rows, width))
        logits = jax.ShapeDtypeStruct((rows, self.model_cfg.padded_vocab_size), jnp.float32,
                                      sharding=self._replicated)
        return _sample_step.lower(logits, self._put(packed), spec=spec, vocab_size=self.model_cfg.vocab_size,
                                  width=self._rows_width).compile()

    @staticmethod
    def fetch(out: SamplerOutput) -> SamplerOutput:
        return SamplerOutput(*jax.device_get(tuple(out)))

    def _pad_copies(self, copies: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(src, dst) padded to max_num_seqs entries; padding targets an out-of-bounds page."""
        width = self.engine_cfg.max_num_seqs
        if len(copies) > width:
            raise ValueError(f"{len(copies)} page copies in one step exceed max_num_seqs={width}")
        src = np.zeros(width, np.int32)
        dst = np.full(width, self.num_pages, np.int32)
        src[: len(copies)], dst[: len(copies)] = copies[:, 0], copies[:, 1]
        return src, dst

    # -- warm-up -------------------------------------------------------------------------------

    def warmup(self, progress: Callable[[int, int, str], None] | None = None) -> float:
        """Compiles and runs every declared shape once; returns seconds taken."""
        start = time.perf_counter()
        buckets = self.builder.buckets
        seq_buckets = sorted({s for _, s in buckets})
        total = len(buckets) + len(seq_buckets) * len(self.history_buckets) + 1
        done = 0

        def tick(what: str) -> None:
            nonlocal done
            done += 1
            if progress:
                progress(done, total, what)

        max_pages, pad_slot = self.engine_cfg.max_pages_per_seq, self.num_pages * self.engine_cfg.page_size
        # Steps feed the sample program's padded ids to the next forward: prime that buffer with a
        # real one, so the forwards below compile for the sharding steps will give them.
        logits, self.kv = self._forward(_dummy_arrays(*buckets[0], max_pages, pad_slot))
        _, self._prev_ids = self._sample(logits, _dummy_sampling(buckets[0][1], 0))
        logits_by_rows = {}  # real forward outputs, so the sampler sees the shardings steps will give it
        for t, s in buckets:
            logits_by_rows[s], self.kv = self._forward(_dummy_arrays(t, s, max_pages, pad_slot))
            tick(f"forward T={t} S={s}")
        for s in seq_buckets:
            for h in self.history_buckets:
                tensors = _dummy_sampling(s, h)
                jax.block_until_ready(self._sample(logits_by_rows[s], tensors))
                tick(f"sample S={s} H={h}")
        self.kv = _copy_step(self.kv, *self._put(self._pad_copies(np.zeros((0, 2), np.int32))))
        jax.block_until_ready(self.kv.k[0])
        tick("page copy")
        self.warmed_up = True
        seconds = time.perf_counter() - start
        logger.info("warm-up compiled %d programs in %.1fs", total, seconds)
        return seconds


def _dummy_arrays(t: int, s: int, max_pages: int, pad_slot: int) -> StepArrays:
    """A bucket-shaped step that writes nothing (every slot is padding) and has no live sequence."""
    z = lambda *shape: np.zeros(shape, np.int32)  # noqa: E731
    return StepArrays(z(t), z(t), z(t), np.full(t, pad_slot, np.int32), z(s + 1), z(s), z(s, max_pages),
                      z(1), z(s), np.full(t, -1, np.int32))


def _dummy_sampling(s: int, h: int) -> SamplingTensors:
    base = SamplingTensors.from_rows([], s, 1)
    return base._replace(table_ids=np.full((s, h), -1, np.int32), table_output_counts=np.zeros((s, h), np.int32),
                         table_seen=np.zeros((s, h), bool), table_bias=np.zeros((s, h), np.float32))
