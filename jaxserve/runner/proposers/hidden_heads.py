"""The hidden-state heads of speculative decoding: an EAGLE-3 head (`{"method": "eagle3", "model": DIR}`,
model/eagle3.py) or the checkpoint's MTP layer (`{"method": "mtp"}`, model/mtp.py): their weights,
K/V pages and programs. Owned by the ModelRunner; device state like it. Both heads have the same
functions (`forward`, `draft_ids`, `abstract`, `logical_dims`); `head_of(cfg)` picks the module.

The head's one layer keeps K/V per position in its own pool of the target's page count and size, so
the target's page tables address it (as draft_runner.py's pool). Its row for position p reads the
target's hidden states at p and the token at p + 1, so it runs one step behind the target's
tokens:

  fill(arrays, shift, aux, sampled)  right after the target step's sampler, over the same token rows:
        each row's next token is known on the host (prompt tokens: `shift.token_ids`) or is this
        step's sampled id (`shift.sample_row`, read on the device); writes the head's K/V for
        every row and keeps, per sampler row, its pre-norm output on the device (no lm_head: most
        steps propose nothing, and the head's lm_head can cost as much as the target's).
  propose(chunks, rows, num_drafts)  before the next step, for decodes with draft slots: the first
        draft is the head's argmax over the last fill's output at the row that sampled the
        sequence's last token; each further draft is one batched forward of the previous draft
        over the head's own output.

No host sync inside a step; the ids reach the host once per proposal. Rejected rows' K/V (the
fill writes every row of a verified run) lies past the sequence's length and is overwritten later.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.model import kv_cache
from jaxserve.parallel import sharding
from jaxserve.core.buckets import Program, choose_bucket, declared_buckets
from jaxserve.core.config import EngineConfig, ModelConfig
from jaxserve.runner.proposers.draft_model import proposal_arrays, proposal_tables
from jaxserve.model import eagle3, mtp
from jaxserve.model.attention import make_attention
from jaxserve.model.kv_heads import repeat_kv
from jaxserve.parallel.kv_heads import duplicated_config, kv_duplication
from jaxserve.model.paged import paged_attend, resolve_token_ids
from jaxserve.model.param_spec import is_spec
from jaxserve.model.weights import Weights
from jaxserve.runner.packing import PackSpec, pack, unpack
from jaxserve.runner.program_store import ProgramTable
from jaxserve.runner.programs import abstract_packed, abstract_weights, dummy_arrays, kv_dtype, rows_width
from jaxserve.core.step_plan import ScheduledChunk
from jaxserve.runner.step_inputs import EagleShift, StepArrays


HeadConfig = eagle3.Eagle3Config | mtp.MtpConfig
HeadWeights = eagle3.Eagle3Weights | mtp.MtpWeights


def head_of(cfg: HeadConfig) -> Any:
    """The module of a head's functions: model/mtp.py or model/eagle3.py."""
    return mtp if isinstance(cfg, mtp.MtpConfig) else eagle3


def target_parts(weights: Weights) -> Weights:
    """What a head reads of the target's weights: its embeddings and its lm_head."""
    return Weights(embed=weights.embed, layers=[], final_norm=None, lm_head=weights.lm_head)


class HeadArrays(NamedTuple):
    step: StepArrays        # token_ids: each row's next token (or prev_sample_row: where to read it)
    hidden_row: np.ndarray  # [T] int32 row of the previous forward's outputs each row continues (propose)


def _head_packed(weights: HeadWeights, target: Weights, kv: kv_cache.KVPages, packed: jax.Array,
                  prev_ids: jax.Array, hidden: jax.Array, spec: PackSpec, cfg: HeadConfig,
                  attention_fn: Any, combine: bool, width: int
                  ) -> tuple[jax.Array | None, jax.Array, kv_cache.KVPages]:
    """One head forward. hidden: the target's aux states [T, 3 Dt] (combine: a fill) or the previous
    forward's outputs [width, D] read at hidden_row (a proposal). Returns the sampler rows' drafts
    padded to [width] (a proposal; a fill computes none: most steps propose nothing), their pre-norm
    outputs padded to [width, D], and the pages."""
    arrays, hidden_row = unpack(packed, spec)
    h = hidden if combine else jnp.take(hidden, hidden_row, axis=0)
    embed = getattr(weights, "embed", None)
    embed = target.embed if embed is None else embed
    pool = kv.layers()
    head = head_of(cfg)
    out, _ = head.forward(weights, cfg, embed, resolve_token_ids(arrays, prev_ids), arrays.positions, h,
                            paged_attend(cfg.layer, arrays, attention_fn, pool), None, arrays.logits_index,
                            combine=combine)
    pad = width - out.shape[0]
    ids = None if combine else jnp.pad(head.draft_ids(weights, cfg, out, target), (0, pad))
    return ids, jnp.pad(out, ((0, pad), (0, 0))), kv_cache.KVPages.from_layers(pool)


_head_step = jax.jit(_head_packed, static_argnames=("spec", "cfg", "attention_fn", "combine", "width"),
                      donate_argnames=("kv",))


def _first(weights: HeadWeights, target: Weights, hidden: jax.Array, rows: jax.Array, cfg: HeadConfig,
           width: int) -> jax.Array:
    """Drafts from the fill's outputs [width, D] at rows [S] (a sequence bucket: the lm_head runs
    over S rows, not width), padded to [width] for the next forward's prev_ids."""
    ids = head_of(cfg).draft_ids(weights, cfg, jnp.take(hidden, rows, axis=0), target)
    return jnp.pad(ids, (0, width - ids.shape[0]))


_first_drafts = jax.jit(_first, static_argnames=("cfg", "width"))


def _duplicate_kv_heads(cfg: HeadConfig, weights: HeadWeights, placement: sharding.Placement
                        ) -> tuple[HeadConfig, HeadWeights]:
    """The head's KV heads repeated for a model axis wider than them, as the target's are
    (model/kv_heads.py), placed with the new shardings."""
    mesh, rules = placement
    factor = kv_duplication(cfg.layer, mesh.shape[sharding.MODEL_AXIS], rules)
    if factor == 1:
        return cfg, weights
    new_cfg = dataclasses.replace(cfg, layer=duplicated_config(cfg.layer, factor))
    layer = repeat_kv(Weights(embed=None, layers=[weights.layer], final_norm=None), factor).layers[0]
    return new_cfg, jax.device_put(weights.replace(layer=layer), placements(new_cfg, placement))


def placements(cfg: HeadConfig, placement: sharding.Placement) -> HeadWeights:
    """NamedSharding of every leaf of the head, from its logical axes (the target's rules)."""
    mesh, rules = placement
    head = head_of(cfg)
    rules = sharding.rules_for(head.logical_dims(cfg), mesh, rules)
    return jax.tree.map(lambda s: sharding.named(mesh, *s.axes, rules=rules, shape=s.shape),
                        head.abstract(cfg), is_leaf=is_spec)


class HeadRunner:
    def __init__(self, cfg: HeadConfig, weights: HeadWeights, target: Weights,
                 engine_cfg: EngineConfig, placement: sharding.Placement, dtype: Any, put: Any,
                 programs: ProgramTable) -> None:
        self.cfg, self.weights = _duplicate_kv_heads(cfg, weights, placement)
        self.engine_cfg = engine_cfg
        self._target = target_parts(target)
        self.kv = kv_cache.allocate(self.cfg.layer, engine_cfg.num_kv_pages, engine_cfg.page_size,
                                    kv_dtype(engine_cfg, dtype), placement)
        self._attention = make_attention(engine_cfg.attention_backend, self.cfg.layer, placement)
        self._put = put
        self._programs = programs  # the target's table: the head's programs are stored with its own
        self._buckets = declared_buckets(engine_cfg)
        self._width = rows_width(engine_cfg)
        self._pad_slot = engine_cfg.num_kv_pages * engine_cfg.page_size
        self._hidden = put(np.zeros((self._width, self.cfg.hidden_size), jnp.dtype(dtype)))  # the last
        # fill's pre-norm output per sampler row [width, D]

    @property
    def aux_layers(self) -> tuple[int, ...]:
        return self.cfg.aux_layers

    def _run(self, arrays: HeadArrays, prev_ids: jax.Array, hidden: jax.Array, combine: bool
             ) -> tuple[jax.Array | None, jax.Array]:
        packed, spec = pack(arrays)
        statics = dict(spec=spec, cfg=self.cfg, attention_fn=self._attention, combine=combine, width=self._width)
        ids, out, self.kv = self._programs.call(("head", spec, combine, hidden.shape), _head_step, statics, ("kv",),
                                                self.weights, self._target, self.kv, self._put(packed),
                                                prev_ids, hidden)
        return ids, out

    def fill(self, arrays: StepArrays, shift: EagleShift, aux: jax.Array, sampled: jax.Array) -> None:
        """The head over the target step's rows (see the module docstring). aux: the step's [T, 3 Dt]
        target states; sampled: the step's sampled ids padded to [width] (the sampler's output)."""
        step = arrays._replace(token_ids=shift.token_ids, prev_sample_row=shift.sample_row, lora_slot=None)
        zeros = np.zeros(len(shift.token_ids), np.int32)
        _, self._hidden = self._run(HeadArrays(step, zeros), sampled, aux, combine=True)

    def copy_pages(self, copy_fn: Any, src: jax.Array, dst: jax.Array) -> None:
        self.kv = copy_fn(self.kv, src, dst)

    def _first(self, rows: Sequence[int]) -> jax.Array:
        padded = np.zeros(choose_bucket(self._buckets, len(rows), len(rows))[1], np.int32)
        padded[:len(rows)] = rows
        statics = dict(cfg=self.cfg, width=self._width)
        return self._programs.call(("head", "first", len(padded)), _first_drafts, statics, (), self.weights,
                                   self._target, self._hidden, self._put(padded))

    def propose(self, chunks: Sequence[ScheduledChunk], rows: Sequence[int], num_drafts: Sequence[int]
                ) -> list[list[int]]:
        """Greedy drafts for decode chunks whose last token (at start_pos) was sampled at `rows[i]` of
        the last fill: num_drafts[i] ids each. The first from the fill's output at that row; forward
        j (j >= 1) feeds draft j at position start + j - 1 (written only while j < num_drafts[i]:
        pages exist there) and yields draft j + 1."""
        n = len(chunks)
        wanted = np.asarray(num_drafts, np.int32)
        tables, starts = proposal_tables(chunks, self.engine_cfg.max_pages_per_seq)
        ids, hidden, hidden_rows = self._first(rows), self._hidden, np.asarray(rows, np.int32)
        drafted = [ids]
        for j in range(1, max(num_drafts)):
            step = proposal_arrays(self._buckets, self.engine_cfg.page_size, self._pad_slot, tables, starts, j - 1,
                                   j < wanted, None, np.arange(n, dtype=np.int32))
            hidden_row = np.zeros(len(step.token_ids), np.int32)
            hidden_row[:n] = hidden_rows
            ids, hidden = self._run(HeadArrays(step, hidden_row), ids, hidden, combine=False)
            drafted.append(ids)
            hidden_rows = np.arange(n, dtype=np.int32)
        got = jax.device_get(drafted)                                       # [steps][width]
        return [[int(got[j][i]) for j in range(d)] for i, d in enumerate(num_drafts)]

    def warm_fill(self, program: Program, aux: jax.Array, sampled: jax.Array) -> None:
        """Compiles and runs the fill of one target forward program, over that forward's real aux
        output (so the program sees the sharding steps give it)."""
        arrays = dummy_arrays(program, self.engine_cfg.max_pages_per_seq, self._pad_slot)
        t = program.tokens
        self.fill(arrays, EagleShift(np.zeros(t, np.int32), np.full(t, -1, np.int32)), aux, sampled)

    def warm_propose(self) -> int:
        """Compiles and runs the first drafts and the proposal forward of every bucket a proposal
        can pick (n sequences in a bucket of n tokens), twice: from a fill's outputs and from a
        proposal's; returns how many buckets."""
        cfg = self.engine_cfg
        buckets = {choose_bucket(self._buckets, n, n): n for n in range(cfg.max_num_seqs, 0, -1)}
        for n in buckets.values():
            step = proposal_arrays(self._buckets, cfg.page_size, self._pad_slot,
                                   np.zeros((n, cfg.max_pages_per_seq), np.int32), np.zeros(n, np.int32), 0,
                                   np.zeros(n, bool), None, np.zeros(n, np.int32))
            arrays = HeadArrays(step, np.zeros(len(step.token_ids), np.int32))
            ids, hidden = self._run(arrays, self._first([0] * n), self._hidden, combine=False)
            jax.block_until_ready(self._run(arrays, ids, hidden, combine=False))
        return len(buckets)


def lower_head(program: Program, cfg: HeadConfig, target: ModelConfig, engine_cfg: EngineConfig,
                placement: sharding.Placement, dtype: Any, attention_fn: Any, combine: bool = True
                ) -> jax.stages.Lowered:
    """The head's fill (combine: after the target forward `program`) or its proposal forward (over
    `program`'s bucket) lowered for `placement`'s mesh from shapes alone, as programs.lower_program lowers the
    target's: no weights, no device memory. attention_fn: make_attention for the head's layer."""
    mesh, rules = placement
    replicated = sharding.replicated(mesh)
    specs = head_of(cfg).abstract(cfg, dtype)
    weights = jax.tree.map(lambda p, s: jax.ShapeDtypeStruct(p.shape, jnp.dtype(p.dtype), sharding=s), specs,
                           placements(cfg, placement), is_leaf=is_spec)
    target_weights = target_parts(abstract_weights(target, dtype, placement))
    num_pages, page_size = engine_cfg.num_kv_pages, engine_cfg.page_size
    kv = kv_cache.abstract(cfg.layer, num_pages, page_size, kv_dtype(engine_cfg, dtype), placement)
    width = rows_width(engine_cfg)
    if not combine:
        program = Program("forward", program.tokens, program.rows)  # a proposal samples every sequence row
    arrays = dummy_arrays(program, engine_cfg.max_pages_per_seq, num_pages * page_size)
    packed, spec = abstract_packed(HeadArrays(arrays, np.zeros(program.tokens, np.int32)), mesh)
    hidden = ((program.tokens, len(cfg.aux_layers) * cfg.target_hidden_size) if combine
              else (width, cfg.hidden_size))
    return _head_step.lower(weights, target_weights, kv, packed, jax.ShapeDtypeStruct((width,), jnp.int32, sharding=replicated),
                             jax.ShapeDtypeStruct(hidden, jnp.dtype(dtype), sharding=replicated), spec=spec, cfg=cfg,
                             attention_fn=attention_fn, combine=combine, width=width)
