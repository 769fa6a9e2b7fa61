"""The draft model of speculative decoding (`{"method": "draft_model", "model": DIR}`): its weights,
its KV pages and its programs. Owned by the ModelRunner; device state like it.

The draft's pool has the target's page count and page size, so one page table addresses both: a
sequence's pages hold the target's K/V and the draft's for the same positions, the allocator and
the prefix cache need no second bookkeeping, and the pool budget counts both models' bytes per
token (capacity.plan_capacity).

Per engine step:
  propose(chunks)  before the step, for each decode chunk with draft slots: the chunk's last known
                   token at its position, then the draft's own argmax fed back on the device, one
                   token per sequence per draft forward, k forwards batched across sequences;
                   the ids come back to the host once.
  fill(arrays)     with the target's forward, over the same step arrays: the draft's K/V for every
                   token the target computes (prefill chunks, decodes, drafts), no lm_head.
Rejected drafts' K/V lies past the sequence's length in both pools and is overwritten later, so the
draft's K/V always mirrors the target's verified tokens.
"""

from __future__ import annotations

import dataclasses

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.core.buckets import Program, choose_bucket, declared_buckets
from jaxserve.core.config import EngineConfig, ModelConfig
from jaxserve.core.step_plan import ScheduledChunk
from jaxserve.model import kv_cache
from jaxserve.model.attention import make_attention
from jaxserve.model.weights import Weights
from jaxserve.parallel import sharding
from jaxserve.runner.packing import pack
from jaxserve.runner.program_store import ProgramTable
from jaxserve.runner.programs import DONATED, dummy_arrays, forward_step, kv_dtype, rows_width
from jaxserve.runner.sampler import argmax_rows
from jaxserve.runner.step_inputs import StepArrays


def _argmax_padded(logits: jax.Array, vocab_size: int, width: int) -> jax.Array:
    """[S, Vp] logits -> [width] int32 argmax ids of the real vocabulary, zero-padded."""
    ids = argmax_rows(logits[:, :vocab_size].astype(jnp.float32))
    return jnp.pad(ids, (0, width - ids.shape[0]))


_argmax_step = jax.jit(_argmax_padded, static_argnames=("vocab_size", "width"))


def check_compatible(target: ModelConfig, draft: ModelConfig) -> None:
    """A draft must speak the target's vocabulary: its ids are the target's proposals."""
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"--speculative-config draft model has vocab_size {draft.vocab_size}, the target "
                         f"{target.vocab_size}: a draft must use the target's tokenizer")


def proposal_tables(chunks: Sequence[ScheduledChunk], max_pages: int) -> tuple[np.ndarray, np.ndarray]:
    """([n, max_pages] page tables, [n] start positions) of the decode chunks a draft proposes for."""
    tables = np.zeros((len(chunks), max_pages), np.int32)
    for i, c in enumerate(chunks):
        tables[i, :len(c.page_table)] = c.page_table
    return tables, np.asarray([c.start_pos for c in chunks], np.int32)


def proposal_arrays(buckets: Sequence[tuple[int, int]], page_size: int, pad_slot: int, tables: np.ndarray,
                    starts: np.ndarray, offset: int, active: np.ndarray, token_ids: np.ndarray | None,
                    prev_row: np.ndarray | None) -> StepArrays:
    """One draft forward of one token per sequence (n = len(starts) rows, each its own sequence,
    each sampling): row i at starts[i] + offset, its token given (token_ids) or the previous
    forward's output at prev_row[i]. Rows not `active` write nothing (padding slot) and are ignored."""
    n = len(starts)
    t, s = choose_bucket(buckets, n, n)
    rows = np.arange(n, dtype=np.int32)
    pos = np.where(active, starts + offset, starts).astype(np.int32)
    pad = lambda length, fill=0: np.full(length, fill, np.int32)  # noqa: E731
    tok, position, token_seq, slots, prev = pad(t), pad(t), pad(t), pad(t, pad_slot), pad(t, -1)
    seq_lens, cu, logits_index = pad(s), pad(s + 1, n), pad(s)
    page_tables = np.zeros((s, tables.shape[1]), np.int32)
    if token_ids is not None:
        tok[:n] = token_ids
    if prev_row is not None:
        prev[:n] = prev_row
    position[:n] = pos
    token_seq[:n] = rows
    slots[:n] = np.where(active, tables[rows, pos // page_size] * page_size + pos % page_size, pad_slot)
    seq_lens[:n] = pos + 1
    cu[:n + 1] = np.arange(n + 1)
    page_tables[:n] = tables
    logits_index[:n] = rows
    return StepArrays(tok, position, token_seq, slots, cu, seq_lens, page_tables, np.array([n], np.int32),
                      logits_index, prev)


class DraftRunner:
    def __init__(self, cfg: ModelConfig, weights: Weights, engine_cfg: EngineConfig, placement: sharding.Placement,
                 dtype: Any, put: Any, programs: ProgramTable) -> None:
        # its steps read the target's first layer group's page tables: one group of its own
        self.cfg = cfg = dataclasses.replace(cfg, single_kv_group=True)
        self.weights = weights
        self.engine_cfg = engine_cfg
        self.kv = kv_cache.allocate(cfg, engine_cfg.num_kv_pages, engine_cfg.page_size,
                                    kv_dtype(engine_cfg, dtype), placement)
        self._attention = make_attention(engine_cfg.attention_backend, cfg, placement)
        self._put = put
        self._programs = programs  # the target's table: the draft's programs are stored with its own
        self._buckets = declared_buckets(engine_cfg)
        self._width = rows_width(engine_cfg)  # the target's prev_ids length: fill passes its buffer
        self._pad_slot = engine_cfg.num_kv_pages * engine_cfg.page_size
        self._zeros = put(np.zeros(self._width, np.int32))

    def _forward(self, arrays: StepArrays, prev_ids: jax.Array) -> jax.Array:
        packed, spec = pack(arrays)
        statics = dict(spec=spec, cfg=self.cfg, attention_fn=self._attention)
        logits, self.kv = self._programs.call(("draft", "forward", spec), forward_step, statics, DONATED, self.weights,
                                              kv=self.kv, packed=self._put(packed), prev_ids=prev_ids)
        return logits

    def _argmax(self, logits: jax.Array) -> jax.Array:
        statics = dict(vocab_size=self.cfg.vocab_size, width=self._width)
        return self._programs.call(("draft", "argmax", logits.shape), _argmax_step, statics, (), logits)

    def fill(self, arrays: StepArrays, prev_ids: jax.Array) -> None:
        """The draft's K/V for the target step's tokens (same slots, same in-flight ids)."""
        self._forward(arrays._replace(logits_index=np.zeros(0, np.int32), lora_slot=None), prev_ids)

    def copy_pages(self, copy_fn: Any, src: jax.Array, dst: jax.Array) -> None:
        self.kv = copy_fn(self.kv, src, dst)

    def propose(self, chunks: Sequence[ScheduledChunk], num_drafts: Sequence[int]) -> list[list[int]]:
        """Greedy drafts for decode chunks (token_ids[0] known, at start_pos): num_drafts[i] ids each.
        Forward j writes position start + j of the rows still drafting (j < num_drafts[i]: their
        pages exist); finished rows write nothing (padding slot) and their ids are ignored."""
        n = len(chunks)
        wanted = np.asarray(num_drafts, np.int32)
        tables, starts = proposal_tables(chunks, self.engine_cfg.max_pages_per_seq)
        first = np.asarray([c.token_ids[0] for c in chunks], np.int32)
        prev = self._zeros
        drafted = []
        for j in range(max(num_drafts)):
            # forward j: position start + j; the known last token first, then the previous argmax
            arrays = proposal_arrays(self._buckets, self.engine_cfg.page_size, self._pad_slot, tables,
                                     starts, j, j < wanted, first if j == 0 else None,
                                     None if j == 0 else np.arange(n, dtype=np.int32))
            prev = self._argmax(self._forward(arrays, prev))
            drafted.append(prev)
        ids = np.stack(jax.device_get(drafted))                             # [steps, width]
        return [ids[:d, i].tolist() for i, d in enumerate(num_drafts)]

    def warmup(self, prev_ids: jax.Array) -> int:
        """Compiles and runs, per forward bucket, the fill (no logits) and the proposal forward, and
        the argmax per sequence bucket; returns how many programs that was."""
        max_pages = self.engine_cfg.max_pages_per_seq
        for t, s in self._buckets:
            arrays = dummy_arrays(Program("forward", t, s), max_pages, self._pad_slot)
            self.fill(arrays, prev_ids)
            logits = self._forward(arrays, prev_ids)
            jax.block_until_ready(self._argmax(logits))
        return 2 * len(self._buckets) + len({s for _, s in self._buckets})

