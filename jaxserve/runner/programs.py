"""The programs a model runner serves with, jitted once per process, and their abstract signatures.

Three jitted functions (module level, so runners of the same model config share compiled programs:
the cache key is the static config plus the input shapes and shardings):
  forward_step (bucket T x S): embed -> layers over the donated KV pages -> logits of the S sample rows
  sample_step  (bucket S x H): grammar bitmask/penalties/temperature/top-k/top-p/min-p -> token ids, logprobs
  copy_step: copy-on-write page copies (prefix caching)

`buckets.serving_programs(engine_cfg, model_cfg)` lists every program warm-up compiles; `lower_program`
lowers one of them from shapes alone (`ShapeDtypeStruct`s derived from `weights.abstract(cfg)` and
the KV pool's declaration) for any mesh, real or compile-only (targets.py): no weights, no device
memory. `jaxserve plan` compiles them for a TPU or GPU it does not have.

Step inputs arrive packed in one int32 buffer (packing.py): one transfer per program.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from jaxserve.model import kv_cache
from jaxserve.parallel import sharding
from jaxserve.core.buckets import Program, declared_buckets, logits_buckets
from jaxserve.core.capacity import state_slot_counts
from jaxserve.core.config import EngineConfig, ModelConfig
from jaxserve.model import weights as weights_mod
from jaxserve.model.expert_parallel import make_moe
from jaxserve.model.paged import forward_paged
from jaxserve.model.weights import Weights
from jaxserve.runner.packing import PackSpec, pack, unpack
from jaxserve.quant import kv as kv_quant
from jaxserve.runner.sampler import SamplerOutput, bitmask_words, count_in_flight, sample
from jaxserve.runner.sampling_tensors import SamplingTensors
from jaxserve.runner.step_inputs import StepArrays


def _forward_packed(weights: Weights, kv: kv_cache.KVPages, packed: jax.Array, spec: PackSpec, cfg: ModelConfig,
                    attention_fn: Callable[..., jax.Array], prev_ids: jax.Array, lora: Any = None,
                    aux_layers: tuple[int, ...] = (), moe_fn: Callable[..., jax.Array] | None = None
                    ) -> tuple[Any, ...]:
    """(logits, pages), plus the EAGLE-3 head's input states with `aux_layers` (model/paged.py)."""
    return forward_paged(weights, cfg, kv, unpack(packed, spec), attention_fn, prev_ids, lora, aux_layers, moe_fn)


FORWARD_STATICS = ("spec", "cfg", "attention_fn", "aux_layers", "moe_fn")
DONATED = ("kv",)  # the KV pool, in forward_step and copy_step (program_store.py jits them again)
forward_step = jax.jit(_forward_packed, static_argnames=FORWARD_STATICS, donate_argnames=DONATED)


def _sample_and_keep(logits: jax.Array, packed: jax.Array, bitmask: jax.Array, prev_ids: jax.Array, spec: PackSpec,
                     vocab_size: int, width: int) -> tuple[SamplerOutput, jax.Array]:
    """sample(), plus its token ids padded to [width] for the next step's forward (prev_ids).
    bitmask: [S, bitmask_words(vocab_size)] int32, a separate argument (not packed) so that steps
    without constrained rows pass one resident all-ones array and transfer nothing. prev_ids: the
    previous step's ids ([width]), for penalty rows whose last token is still in flight."""
    tensors = unpack(packed, spec)
    if tensors.needs_history:
        tensors = count_in_flight(tensors, prev_ids)
    out = sample(logits, tensors, vocab_size, bitmask)
    return out, jnp.pad(out.token_ids, (0, width - out.token_ids.shape[0]))


sample_step = jax.jit(_sample_and_keep, static_argnames=("spec", "vocab_size", "width"))
copy_step = jax.jit(kv_cache.copy_pages, donate_argnames=DONATED)


def rows_width(engine_cfg: EngineConfig) -> int:
    """Length of the device buffer of last-step sampled ids: the most logits rows of any bucket."""
    return max(max(logits_buckets(engine_cfg, t, s)) for t, s in declared_buckets(engine_cfg))


def dummy_arrays(program: Program, max_pages: int, pad_slot: int, lora: bool = False,
                 state_slots: int = 0) -> StepArrays:
    """A forward bucket's step that writes nothing (every slot is padding) and has no live sequence
    (lora: with the per-token adapter slots that LoRA-enabled steps carry; state_slots: a hybrid
    stack's slot count, every row's slot out of bounds)."""
    t, s = program.tokens, program.rows
    z = lambda *shape: np.zeros(shape, np.int32)  # noqa: E731
    return StepArrays(z(t), z(t), z(t), np.full(t, pad_slot, np.int32), z(s + 1), z(s), z(s, max_pages),
                      z(1), z(program.logits), np.full(t, -1, np.int32), np.full(t, -1, np.int32) if lora else None,
                      *((np.full(s, state_slots, np.int32),) * 2 if state_slots else ()))


def dummy_sampling(s: int, h: int) -> SamplingTensors:
    base = SamplingTensors.from_rows([], s, 1)
    return base._replace(table_ids=np.full((s, h), -1, np.int32), table_output_counts=np.zeros((s, h), np.int32),
                         table_seen=np.zeros((s, h), bool), table_bias=np.zeros((s, h), np.float32))


def table_width(engine_cfg: EngineConfig, model_cfg: ModelConfig) -> int:
    """Columns of a forward step's page_tables: every KV layer group's table side by side."""
    return engine_cfg.max_pages_per_seq * model_cfg.kv_groups.num_groups


def num_state_slots(engine_cfg: EngineConfig, model_cfg: ModelConfig) -> int:
    """A hybrid stack's recurrent-state slots in all (0 without linear layers): capacity.state_slot_counts."""
    return sum(state_slot_counts(model_cfg, engine_cfg.max_num_seqs, engine_cfg.enable_prefix_caching))


def pad_state_copies(pairs: np.ndarray | None, num_slots: int) -> tuple[np.ndarray, ...]:
    """(src, dst) state-slot copies [N] each, padded with out-of-bounds slots (which copy nothing);
    () for a stack without state slots."""
    if not num_slots:
        return ()
    padded = np.full((num_slots, 2), num_slots, np.int32)
    if pairs is not None:
        padded[:len(pairs)] = pairs
    return padded[:, 0].copy(), padded[:, 1].copy()


def copy_width(engine_cfg: EngineConfig, model_cfg: ModelConfig) -> int:
    """Page copies one step may carry (one per sequence and KV layer group)."""
    return engine_cfg.max_num_seqs * model_cfg.kv_groups.num_groups


def abstract_weights(model_cfg: ModelConfig, dtype: Any, placement: sharding.Placement) -> Weights:
    """The weight pytree as ShapeDtypeStructs placed by `placement` (no memory)."""
    return weights_mod.abstract_arrays(model_cfg, dtype, *placement)


def abstract_lora(model_cfg: ModelConfig, engine_cfg: EngineConfig, dtype: Any, placement: sharding.Placement) -> Any:
    """The LoRA slots' declaration (runner/lora_slots.py), or None without LoRA."""
    if not engine_cfg.enable_lora:
        return None
    from jaxserve.runner import lora_slots

    return lora_slots.abstract(model_cfg, engine_cfg, dtype, placement)


def kv_dtype(engine_cfg: EngineConfig, dtype: Any) -> np.dtype:
    """The KV pages' storage dtype: --kv-cache-dtype, or the compute dtype for "auto"."""
    return kv_quant.storage_dtype(engine_cfg.kv_cache_dtype, dtype)


def abstract_packed(tree: Any, mesh: Mesh) -> tuple[jax.ShapeDtypeStruct, PackSpec]:
    """A host pytree's packed buffer as a replicated ShapeDtypeStruct, and its layout."""
    buf, spec = pack(tree)
    return jax.ShapeDtypeStruct(buf.shape, jnp.int32, sharding=sharding.replicated(mesh)), spec


def lower_program(program: Program, model_cfg: ModelConfig, engine_cfg: EngineConfig, placement: sharding.Placement,
                  dtype: Any, attention_fn: Callable[..., jax.Array], aux_layers: tuple[int, ...] = ()
                  ) -> jax.stages.Lowered:
    """Lowers `program` for `placement`'s mesh from shapes alone, with the attention function
    serving would use there (model/attention.make_attention) and the same rules. The sampler's logits come
    vocab-split as the forward leaves them. aux_layers: a forward that also returns an EAGLE-3
    head's input states."""
    # The mesh's devices as the default one while lowering: jax 0.11's Pallas Triton lowering reads
    # the GPU it compiles for off the default device (a CPU one in a process that compiles for a
    # compile-only GPU target).
    mesh = placement.mesh
    with jax.default_device(mesh.devices.flat[0]), contextlib.ExitStack() as scope:
        if model_cfg.moe is not None:
            from jaxserve.model.moe import compile_scope

            scope.enter_context(compile_scope(mesh))  # the experts' kernels for the target's devices
        return _lower(program, model_cfg, engine_cfg, placement, dtype, attention_fn, aux_layers)


def _lower(program: Program, model_cfg: ModelConfig, engine_cfg: EngineConfig, placement: sharding.Placement,
           dtype: Any, attention_fn: Callable[..., jax.Array], aux_layers: tuple[int, ...]) -> jax.stages.Lowered:
    mesh, rules = placement
    replicated = sharding.replicated(mesh)
    host = lambda tree: abstract_packed(tree, mesh)  # noqa: E731
    num_pages, page_size = engine_cfg.num_kv_pages, engine_cfg.page_size
    state_slots = num_state_slots(engine_cfg, model_cfg)
    kv = kv_cache.abstract(model_cfg, num_pages, page_size, kv_dtype(engine_cfg, dtype), placement, state_slots, dtype)
    prev_ids = jax.ShapeDtypeStruct((rows_width(engine_cfg),), jnp.int32, sharding=replicated)
    if program.kind == "forward":
        packed, spec = host(dummy_arrays(program, table_width(engine_cfg, model_cfg), num_pages * page_size,
                                         engine_cfg.enable_lora, state_slots))
        return forward_step.lower(abstract_weights(model_cfg, dtype, placement), kv=kv, packed=packed, spec=spec,
                                  cfg=model_cfg, attention_fn=attention_fn, prev_ids=prev_ids,
                                  lora=abstract_lora(model_cfg, engine_cfg, dtype, placement), aux_layers=aux_layers,
                                  moe_fn=make_moe(model_cfg, placement))
    if program.kind == "sample":
        packed, spec = host(dummy_sampling(program.rows, program.history))
        resolved = sharding.rules_for(weights_mod.logical_dims(model_cfg), mesh, rules)
        logits = jax.ShapeDtypeStruct((program.rows, model_cfg.padded_vocab_size), jnp.float32,
                                      sharding=NamedSharding(mesh, sharding.spec(None, "vocab", rules=resolved)))
        bitmask = jax.ShapeDtypeStruct((program.rows, bitmask_words(model_cfg.vocab_size)), jnp.int32,
                                       sharding=replicated)
        return sample_step.lower(logits, packed, bitmask, prev_ids, spec=spec, vocab_size=model_cfg.vocab_size,
                                 width=rows_width(engine_cfg))
    index = jax.ShapeDtypeStruct((copy_width(engine_cfg, model_cfg),), jnp.int32, sharding=replicated)
    if not state_slots:
        return copy_step.lower(kv, index, index)
    states = jax.ShapeDtypeStruct((state_slots,), jnp.int32, sharding=replicated)
    return copy_step.lower(kv, index, index, states, states)
