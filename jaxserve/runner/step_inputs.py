"""StepPlan -> fixed-bucket numpy arrays. The only place that pads.

A step is one flat ragged batch: `T` token rows (a bucket >= the plan's tokens), `S` sequence rows
(a bucket >= the plan's chunks); the rows that sample are gathered before the lm_head: at most one
per sequence, so S of them, or with speculative decoding 1 + d per sequence with d drafts
(`buckets.logits_buckets`: L = S, or min(T, S (1 + k)) for a step with drafts). A draft row samples as if its drafts before it had
been emitted: its output count (seed key, min_tokens), penalty table and grammar state include them. Buckets are declared by the
engine config as (T, S) pairs with S <= T and T <= max_num_batched_tokens, so padding never exceeds
the step's token budget. Padding rows write to the out-of-bounds slot (dropped) and belong to no
live sequence (`num_seqs` stops the attention there).

Async scheduling: a decode whose token is still on the device (`PENDING_TOKEN` in the plan) gets
`prev_sample_row` = its row in the previous step's sampler output; the jitted step reads the id
from there. Its sampling row counts that token (seed key, min_tokens) without knowing its id; a
row with penalties has it counted into its table on the device (sampling_step.py).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from jaxserve.core.buckets import choose_bucket, choose_logits_rows, declared_buckets
from jaxserve.core.config import EngineConfig
from jaxserve.runner.batch_rows import EMPTY_ROW, BatchRows
from jaxserve.runner.sampler import bitmask_words
from jaxserve.runner.sampling_step import sampling_step
from jaxserve.runner.sampling_tensors import SamplingTensors
from jaxserve.core.step_plan import PENDING_TOKEN, DecodeRows, ScheduledChunk, StepPlan
from jaxserve.structured.guide import fill_bitmask


class StepArrays(NamedTuple):
    token_ids: np.ndarray      # [T] int32
    positions: np.ndarray      # [T] int32
    token_seq: np.ndarray      # [T] int32  sequence row of each token (padding -> 0)
    slot_mapping: np.ndarray   # [T] int32  page * page_size + offset; padding -> num_pages * page_size
    cu_q_lens: np.ndarray      # [S + 1] int32
    seq_lens: np.ndarray       # [S] int32  tokens in the cache after this step
    page_tables: np.ndarray    # [S, G * max_pages_per_seq] int32: each KV layer group's table side by side
    num_seqs: np.ndarray       # [1] int32
    logits_index: np.ndarray   # [L] int32  token rows that sample (padding -> 0)
    prev_sample_row: np.ndarray  # [T] int32  -1: token_ids holds the id; r >= 0: the id sampled at
                                 # row r of the previous step (an in-flight token)
    lora_slot: np.ndarray | None = None  # [T] int32 multi-LoRA: the token's adapter slot, -1 = base
                                         # model; None when LoRA is off
    state_slot: np.ndarray | None = None  # [S] int32 a hybrid stack's recurrent-state slot per sequence
                                          # row (padding -> the slot count); None without linear layers
    state_snapshot: np.ndarray | None = None  # [S] int32 a snapshot slot the row's end state is also
                                              # written to (none -> the slot count)


class EagleShift(NamedTuple):
    """What an EAGLE-3 head reads beside each token row (eagle_runner.py): the token after it."""
    token_ids: np.ndarray      # [T] int32  the next token where the host knows it (prompt), else 0
    sample_row: np.ndarray     # [T] int32  r >= 0: the next token is this step's sampled id at row r


class StepInputs(NamedTuple):
    arrays: StepArrays
    sampling: SamplingTensors
    num_samples: int           # leading rows of the sampler output that are real
    copies: np.ndarray         # [C, 2] int32 (src, dst) page copies before the step; may be empty
    eagle_shift: EagleShift | None = None  # with an EAGLE-3 head only
    state_copies: np.ndarray | None = None  # [C, 2] int32 (src, dst) state-slot copies before the step
                                            # (a hybrid stack's forks); None without linear layers


class StepInputBuilder:
    def __init__(self, cfg: EngineConfig, num_pages: int, vocab_size: int, eagle: bool = False,
                 num_groups: int = 1, num_state_slots: int = 0) -> None:
        """eagle: also build each step's EagleShift (an EAGLE-3 head proposes); num_groups: the
        model's KV layer groups (core/kv_groups.py), whose tables sit side by side in page_tables;
        num_state_slots: a hybrid stack's recurrent-state slots (0: none)."""
        self.num_state_slots = num_state_slots
        self.cfg = cfg
        self.eagle = eagle
        self.num_pages = num_pages
        self.vocab_size = vocab_size
        self.buckets = declared_buckets(cfg)
        self.pad_slot = num_pages * cfg.page_size
        self.num_groups = num_groups
        self.rows = BatchRows(cfg.max_pages_per_seq, cfg.page_size, vocab_size, num_groups=num_groups)

    def build(self, plan: StepPlan, prev_plan: StepPlan | None = None) -> StepInputs:
        """Every request arrives seeded (the engine draws a seed when the user gave none); sample i
        of a request uses seed + i, so the n samples differ and each is reproducible.

        `prev_plan` is the step dispatched just before this one; it is needed when `plan` has
        PENDING_TOKEN decodes (their ids are that step's sampled ids). Raises ValueError when a
        pending token has no row there.

        The sequences' rows persist across steps (batch_rows.py): a plan's chunks only refresh
        them; per chunk a few list operations, every array a vectorized gather."""
        rows = self.rows
        rows.release(plan.released)
        d, chunks = plan.decodes, plan.listed
        nd = len(d)
        nc = nd + len(chunks)
        t_bucket, s_bucket = choose_bucket(self.buckets, plan.num_tokens, nc)
        l_bucket = choose_logits_rows(self.cfg, t_bucket, s_bucket, plan.num_samples)
        owners = plan.owners
        # the steady decodes: token row i is sequence row i, its page entries already in its row
        slot_of = [rows.slot_of.get(seq) for seq in d.seqs]
        if None in slot_of:  # a sequence this builder has not seen (its earlier plans built elsewhere)
            slot_of = [self._row_of(plan, i) if slot is None else slot for i, slot in enumerate(slot_of)]
        lens, starts, flat = [1] * nd, d.positions[:], d.token_ids[:]
        pending: list[tuple[int, ScheduledChunk]] = []
        sampling: list[tuple[int, int, ScheduledChunk]] = []  # (token row after the chunk, slot, chunk)
        t = nd
        for c in chunks:
            ids, start = c.token_ids, c.start_pos
            n = len(ids)
            slot = rows.slot(owners[c.seq_id], c.page_table, start, c.group_page_tables)
            slot_of.append(slot)
            lens.append(n)
            starts.append(start)
            flat += ids
            t += n
            if ids[-1] == PENDING_TOKEN:  # only ever a 1-token decode
                pending.append((t - 1, c))
            if c.sample:
                sampling.append((t, slot, c))
        rows.flush()
        len_arr = np.array(lens, np.int64)
        start_arr = np.array(starts, np.int64)
        ps = self.cfg.page_size
        token_ids = np.zeros(t_bucket, np.int32)
        token_ids[:t] = flat
        prev_row = np.full(t_bucket, -1, np.int32)
        if pending or PENDING_TOKEN in d.token_ids:
            self._pending_rows(d, pending, prev_plan, token_ids, prev_row, start_arr[:nd])
        seq_of_token = np.repeat(np.arange(nc), len_arr)                # [t]
        cu = np.zeros(s_bucket + 1, np.int32)
        np.cumsum(len_arr, out=cu[1:nc + 1])
        cu[nc + 1:] = t
        token_seq = np.zeros(t_bucket, np.int32)
        token_seq[:t] = seq_of_token
        pos = start_arr[seq_of_token] + np.arange(t) - cu[seq_of_token]
        positions = np.zeros(t_bucket, np.int32)
        positions[:t] = pos
        row_of_seq = np.full(s_bucket, EMPTY_ROW, np.int64)  # padding sequence rows read the empty row's zeros
        row_of_seq[:nc] = slot_of
        page_tables = rows.pages[row_of_seq]
        slots = np.full(t_bucket, self.pad_slot, np.int32)
        slots[:t] = page_tables[seq_of_token, pos // ps] * ps + pos % ps  # the first group's (model/paged.py)
        seq_lens = np.zeros(s_bucket, np.int32)
        seq_lens[:nc] = start_arr + len_arr
        lora_slot = None
        if self.cfg.enable_lora:
            lora_slot = np.full(t_bucket, -1, np.int32)
            lora_slot[:t] = np.array([s.lora_slot for s in d.seqs] + [c.lora_slot for c in chunks],
                                     np.int32)[seq_of_token]
        shift = None
        if self.eagle:
            shift = EagleShift(np.zeros(t_bucket, np.int32), np.full(t_bucket, -1, np.int32))
            shift.sample_row[:nd] = np.arange(nd)  # a steady decode's next token is its own sample
            row = nd
            for i, c in enumerate(chunks):
                _shift_chunk(shift, int(cu[nd + i]), c, plan, row)
                row += c.num_sample_rows
        logits_index, tensors = sampling_step(rows, d, slot_of[:nd], sampling, l_bucket, prev_row)
        state_slot = snapshot = state_copies = None
        if self.num_state_slots:
            of = plan.state_slots
            state_slot = np.full(s_bucket, self.num_state_slots, np.int32)
            state_slot[:nc] = [of[s.seq_id] for s in d.seqs] + [of[c.seq_id] for c in chunks]
            snapshot = np.full(s_bucket, self.num_state_slots, np.int32)
            for i, c in enumerate(chunks):  # only prefill chunks snapshot: listed, never steady decodes
                if c.seq_id in plan.state_snapshots:
                    snapshot[nd + i] = plan.state_snapshots[c.seq_id]
            state_copies = np.asarray(plan.state_copies, np.int32).reshape(-1, 2)
        arrays = StepArrays(token_ids, positions, token_seq, slots, cu, seq_lens, page_tables,
                            np.array([nc], np.int32), logits_index, prev_row, lora_slot, state_slot, snapshot)
        copies = np.asarray(plan.copies, np.int32).reshape(-1, 2)
        return StepInputs(arrays, tensors, plan.num_samples, copies, shift, state_copies)

    def _row_of(self, plan: StepPlan, i: int) -> int:
        """The row of the plan's steady decode i, written whole from its live page tables."""
        seq = plan.decodes.seqs[i]
        tables = plan.page_tables(seq.seq_id)
        return self.rows.slot(seq, tables[0], plan.decodes.positions[i], tables if len(tables) > 1 else ())

    @staticmethod
    def _pending_rows(decodes: DecodeRows, pending: list[tuple[int, ScheduledChunk]], prev_plan: StepPlan | None,
                      token_ids: np.ndarray, prev_row: np.ndarray, decode_starts: np.ndarray) -> None:
        """Token rows whose id is the previous step's sample: read on the device from its row. The
        steady decodes' (token row i is decode i, found among the previous step's steady decodes
        with arrays) and the listed chunks' (`pending`, and decodes the previous step listed).

        The previous step sampled start - 1 in a row of its own (a chunk with drafts emits an
        accepted run: the engine completes its step before planning on it); ValueError otherwise."""
        nd = len(decodes)
        at = np.flatnonzero(token_ids[:nd] == PENDING_TOKEN)
        rows = np.full(at.size, -1, np.int64)
        if at.size and prev_plan is not None and prev_plan.decodes.seqs:
            prev = prev_plan.decodes
            index = dict(zip(prev.seqs, range(len(prev))))
            seqs = decodes.seqs
            rows = np.array([index.get(seqs[i], -1) for i in at.tolist()], np.int64)
            found = rows >= 0
            before = np.asarray(prev.positions, np.int64)[rows[found]]
            rows[found] = np.where(before == decode_starts[at[found]] - 1, rows[found], -1)
        listed = [(int(t), decodes.seqs[t].seq_id, int(decode_starts[t])) for t in at[rows < 0]]
        listed += [(t, c.seq_id, c.start_pos) for t, c in pending]
        if listed:
            spans = sampler_spans(prev_plan)
            at, rows = at[rows >= 0].tolist(), rows[rows >= 0].tolist()
            for t, seq_id, start in listed:
                span = spans.get(seq_id)
                if span is None or span[2] != 1 or span[0] != start - 1:
                    raise ValueError(f"{seq_id!r} decodes a pending token that the previous step did not sample")
                at.append(t)
                rows.append(span[1])
        token_ids[at] = 0
        prev_row[at] = rows


def _shift_chunk(shift: EagleShift, t: int, c: ScheduledChunk, plan: StepPlan, first_row: int) -> None:
    """The token after each of the chunk's rows (at token rows t..): a row that samples reads its
    sampled id (a draft row's sample, not its draft: where verification stops, the sample is the
    token that follows); the others the next prompt (or recomputed) token."""
    n, sampled = len(c.token_ids), c.num_sample_rows
    if sampled:
        shift.token_ids[t:t + n - sampled] = c.token_ids[1:n - sampled + 1]
        shift.sample_row[t + n - sampled:t + n] = np.arange(first_row, first_row + sampled)
    else:  # a prefill chunk that does not end its prompt: the next one is known
        after = plan.owners[c.seq_id].token_slice(c.start_pos + n, c.start_pos + n + 1) or [0]
        shift.token_ids[t:t + n] = [*c.token_ids[1:], *after]


def has_constrained_rows(plan: StepPlan) -> bool:
    return any(c.sample and c.request.grammar is not None for c in plan.listed)  # steady decodes have none


def constraint_bitmask(plan: StepPlan, num_rows: int, vocab_size: int) -> np.ndarray | None:
    """[num_rows, ceil(vocab_size / 32)] int32 token masks of the plan's sample rows (in row order)
    from their sequences' grammar state, all ones for unconstrained rows; None when no row is
    constrained. Every token sampled before this step must have been applied (scheduler.update)."""
    if not has_constrained_rows(plan):
        return None
    guides: list = [None] * len(plan.decodes)
    for c in plan.listed:
        if c.sample:
            guide = plan.owners[c.seq_id].guide
            guides.append(guide)
            guides.extend(guide.advanced(c.draft_token_ids[:j]) if guide is not None else None
                          for j in range(1, c.num_sample_rows))
    return fill_bitmask(guides, num_rows, bitmask_words(vocab_size))


def sampler_spans(plan: StepPlan | None) -> dict[str, tuple[int, int, int]]:
    """seq_id -> (position of its first sampling token row, its first row in the plan's sampler
    output, how many rows) for each chunk of `plan` that samples."""
    if plan is None:
        return {}
    d = plan.decodes
    spans = {seq.seq_id: (start, row, 1) for row, (seq, start) in enumerate(zip(d.seqs, d.positions))}
    row = len(d)
    for c in plan.listed:
        if c.sample:
            k = 1 + len(c.draft_token_ids)
            spans[c.seq_id] = (c.start_pos + len(c.token_ids) - k, row, k)
            row += k
    return spans


def row_that_sampled(spans: dict[str, tuple[int, int, int]], c: ScheduledChunk) -> int | None:
    """The sampler row (of the plan `spans` describes) that sampled chunk c's first token, at
    start_pos: the row that computed start_pos - 1; None when that plan did not."""
    first, base, count = spans.get(c.seq_id, (0, 0, 0))
    return base + c.start_pos - 1 - first if first <= c.start_pos - 1 < first + count else None
