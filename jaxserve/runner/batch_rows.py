"""The persistent batch: one host row per running sequence that lives across steps, so a step's
arrays are gathers of rows rather than a rebuild from every sequence's history.

A row holds the sequence's page table, its sampling parameters (fixed at admission) and its
penalty / bias table (distinct token ids with their output count, seen flag and bias). Rows are
updated incrementally: a new sequence (first seen in a plan) is written whole once; each step
rewrites only the page-table entries its chunk writes into (from the page of its first position:
copy-on-write may replace that one; entries before it never change while the sequence holds its
pages) and adds the output tokens appended since the last step to its penalty table. So per-step
host work grows with the rows and the new tokens, never with the context. A row is freed when the
scheduler reports that its sequence left the batch (StepPlan.released: finished, aborted,
preempted); a preempted sequence comes back as a new row.

`SamplingTensors.from_rows` (sampling_tensors.py) is the from-scratch form of the same tables, the
oracle the tests hold these rows to.
"""

from __future__ import annotations

from typing import Iterable, Sequence as Seq

import numpy as np

from jaxserve.core.request import Sequence
from jaxserve.core.step_plan import DecodeRows
from jaxserve.runner.sampling_tensors import GREEDY_TEMPERATURE, PADDING_TEMPERATURE, seed_words

# per-row sampling parameters: name -> (dtype, value of a padding row)
PARAMS = {"temperature": (np.float32, PADDING_TEMPERATURE), "top_k": (np.int32, 0), "top_p": (np.float32, 1.0),
          "min_p": (np.float32, 0.0), "repetition_penalty": (np.float32, 1.0),
          "presence_penalty": (np.float32, 0.0), "frequency_penalty": (np.float32, 0.0),
          "num_logprobs": (np.int32, -1), "constrained": (np.bool_, False)}


class _Penalty:
    """Host bookkeeping of one row's penalty table (the arrays are BatchRows.tab_*[slot])."""

    __slots__ = ("col", "track", "count_outputs", "rep", "bias", "ban", "min_tokens", "banning", "applied", "always")

    def __init__(self, seq: Sequence) -> None:
        p = seq.request.params
        self.col: dict[int, int] = {}          # token id -> its column in the row
        self.rep = p.repetition_penalty != 1.0  # output ids are flagged seen
        self.count_outputs = p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
        self.track = self.rep or self.count_outputs  # output ids enter the table
        self.bias = dict(p.logit_bias or {})
        ban = set(p.stop_token_ids) | (set() if p.ignore_eos else set(seq.request.eos_token_ids))
        self.ban = frozenset(ban) if p.min_tokens > 0 and seq.request.grammar is None else frozenset()
        self.min_tokens = p.min_tokens
        self.banning = False
        self.applied = 0                        # output tokens already counted
        self.always = self.track or bool(self.bias)  # a table every step (else only while banning)


EMPTY_ROW = 0  # a row no sequence gets: padding's parameters and an empty table (one gather fills a step)


class BatchRows:
    """Rows by slot; `slot(seq, ...)` finds or creates a sequence's row and refreshes its page
    entries, `release(seqs)` frees rows. Arrays grow (doubling) when more rows or wider tables are
    needed; slots and columns are reused. Row EMPTY_ROW stays as it was made: a padding row."""


    def __init__(self, max_pages_per_seq: int, page_size: int, vocab_size: int, rows: int = 64,
                 num_groups: int = 1) -> None:
        """num_groups: KV layer groups (core/kv_groups.py), each max_pages_per_seq columns of a row."""
        self.page_size = page_size
        self.group_width = max_pages_per_seq
        self.vocab_size = vocab_size
        self.slot_of: dict[Sequence, int] = {}
        self._free: list[int] = []
        self.pages = np.zeros((0, num_groups * max_pages_per_seq), np.int32)  # [rows, G * max_pages_per_seq]
        self.params = {k: np.zeros(0, dt) for k, (dt, _) in PARAMS.items()}
        self.seed_words = np.zeros((0, 2), np.uint32)             # [rows, 2]
        self.penalty: list[_Penalty | None] = []
        self.penalized: list[bool] = []                           # the row may have a table (penalty[slot] matters)
        self.tab_ids = np.full((0, 0), -1, np.int32)              # [rows, width] distinct ids, -1 = pad
        self.tab_counts = np.zeros((0, 0), np.int32)
        self.tab_seen = np.zeros((0, 0), bool)
        self.tab_bias = np.zeros((0, 0), np.float32)
        self.tab_len = np.zeros(0, np.int64)                      # [rows] columns in use
        # written with one scatter per step (flush) instead of per row: (slot, column, page) entries
        # of the usual decode, (slot, column) increments of tab_counts and flags of tab_seen
        self._entries: tuple[list[int], list[int], list[int]] = ([], [], [])
        self._bumps: tuple[list[int], list[int]] = ([], [])
        self._seen: tuple[list[int], list[int]] = ([], [])
        self._grow_rows(rows)

    def __len__(self) -> int:
        return len(self.slot_of)

    # ---- lifetime ------------------------------------------------------------------------------

    def release(self, seqs: Iterable[Sequence]) -> None:
        self.flush()  # pending increments name slots by number: write them before a slot is reused
        for seq in seqs:
            slot = self.slot_of.pop(seq, None)
            if slot is not None:
                self.penalty[slot] = None
                self.penalized[slot] = False
                self._free.append(slot)

    def slot(self, seq: Sequence, page_table: Seq[int], start: int, group_tables: Seq[Seq[int]] = ()) -> int:
        """seq's row, created on first sight; its page entries from the page of `start` (the
        chunk's first position) on are rewritten from `page_table` (the allocator's live list), or
        with several KV layer groups from each group's table into its columns (group_tables). The
        usual decode's one entry is written at the next flush()."""
        slot = self.slot_of.get(seq)
        if slot is None:
            slot = self._admit(seq)
            first = 0
        else:
            first = start // self.page_size
            if not group_tables and len(page_table) == first + 1:
                entries = self._entries
                entries[0].append(slot)
                entries[1].append(first)
                entries[2].append(page_table[first])
                return slot
        if not group_tables:
            self._write_pages(self.pages[slot], page_table, first)
        for g, table in enumerate(group_tables):
            self._write_pages(self.pages[slot, g * self.group_width:], table, first)
        return slot

    @staticmethod
    def _write_pages(row: np.ndarray, table: Seq[int], first: int) -> None:
        n = len(table)
        if n - first == 1:  # the usual decode: one entry (or none)
            row[first] = table[first]
        elif n > first:
            row[first:n] = table[first:n]

    def _admit(self, seq: Sequence) -> int:
        if not self._free:
            self._grow_rows(2 * len(self.penalty))
        slot = self._free.pop()
        self.slot_of[seq] = slot
        self.pages[slot] = 0
        p = seq.request.params
        v = self.params
        v["temperature"][slot] = 0.0 if p.temperature < GREEDY_TEMPERATURE else p.temperature
        v["top_k"][slot] = p.top_k if 0 < p.top_k < self.vocab_size else 0
        v["top_p"][slot], v["min_p"][slot] = p.top_p, p.min_p
        v["repetition_penalty"][slot] = p.repetition_penalty
        v["presence_penalty"][slot], v["frequency_penalty"][slot] = p.presence_penalty, p.frequency_penalty
        v["num_logprobs"][slot] = -1 if p.logprobs is None else p.logprobs
        v["constrained"][slot] = seq.request.grammar is not None
        if p.seed is None:
            raise ValueError(f"{seq.seq_id!r} has no seed (the engine seeds every request)")
        self.seed_words[slot] = seed_words(p.seed + seq.sample_index)
        pen = _Penalty(seq)
        self.penalty[slot] = pen
        self.penalized[slot] = pen.always or bool(pen.ban)
        self.tab_len[slot] = 0
        self.tab_ids[slot], self.tab_counts[slot], self.tab_seen[slot], self.tab_bias[slot] = -1, 0, False, 0.0
        if self.penalized[slot]:
            prompt = (np.unique(np.asarray(seq.request.prompt_token_ids, np.int64))
                      if p.repetition_penalty != 1.0 else np.zeros(0, np.int64))
            bias_ids = np.fromiter(pen.bias, np.int64, len(pen.bias))
            every = np.concatenate([prompt, bias_ids, np.fromiter(pen.ban, np.int64, len(pen.ban))])
            if every.size and (every.min() < 0 or every.max() >= self.vocab_size):
                raise ValueError(f"token ids of a sampling row must be in [0, {self.vocab_size})")
            ids = np.unique(every)
            self.fit_width(ids.size)
            n = ids.size
            self.tab_ids[slot, :n] = ids
            self.tab_counts[slot, :n] = 0
            self.tab_seen[slot, :n] = np.isin(ids, prompt)
            self.tab_bias[slot, :n] = [pen.bias.get(int(t), 0.0) for t in ids] if pen.bias else 0.0
            self.tab_len[slot] = n
            pen.col = {int(t): i for i, t in enumerate(ids)}
        return slot

    # ---- penalty tables ------------------------------------------------------------------------

    def table_active(self, slot: int, num_outputs: int) -> bool:
        """Whether the row's table adjusts logits when it samples after num_outputs outputs."""
        pen = self.penalty[slot]
        return pen.always or (bool(pen.ban) and num_outputs < pen.min_tokens)

    def apply_outputs(self, slot: int, outputs: Seq[int], num_outputs: int) -> None:
        """Counts the output tokens appended since the last call (the known ones of the first
        num_outputs: an in-flight one is counted on the device, sampler.count_in_flight) and
        switches the min_tokens ban on or off for a row that samples after num_outputs."""
        pen = self.penalty[slot]
        if pen.track:
            known = min(num_outputs, len(outputs))
            if known > pen.applied:
                for token in outputs[pen.applied:known]:
                    self._count(slot, pen, token)
                pen.applied = known
        if not pen.ban:
            return
        banning = num_outputs < pen.min_tokens
        if banning != pen.banning:
            pen.banning = banning
            for token in pen.ban:
                self.tab_bias[slot, pen.col[token]] = -np.inf if banning else pen.bias.get(token, 0.0)

    def apply_decodes(self, decodes: DecodeRows, slots: Seq[int], prev_row: np.ndarray, table_rows: list[int],
                      table_slots: list[int], pending: list[int], pending_src: list[int]) -> None:
        """apply_outputs for a plan's steady decodes (sample row i, token row i, in row slots[i]),
        in one loop: appends to table_rows / table_slots each row whose table is active and its
        slot, and to pending / pending_src each penalty row whose last output is in flight (counted
        on the device) and the previous step's sample row of it. Raises ValueError for a penalty
        row whose in-flight token the previous step did not sample."""
        penalized, penalty = self.penalized, self.penalty
        bumps_slot, bumps_col = self._bumps
        seen_slot, seen_col = self._seen
        prev = prev_row[:len(slots)].tolist()
        for r, (slot, count) in enumerate(zip(slots, decodes.num_outputs)):
            if not penalized[slot]:
                continue
            pen = penalty[slot]
            if pen.track:
                outputs = decodes.seqs[r].output_token_ids
                known = len(outputs)
                if count > known:
                    if count > known + 1 or prev[r] < 0:
                        raise ValueError(f"{decodes.seqs[r].seq_id!r} samples with penalties over "
                                         f"{count - known} output token(s) the previous step did not sample")
                    pending.append(r)
                    pending_src.append(prev[r])
                applied = pen.applied
                if known == applied + 1 and (col := pen.col.get(outputs[applied])) is not None:
                    # the usual step: one new output, an id the table has
                    if pen.count_outputs:
                        bumps_slot.append(slot)
                        bumps_col.append(col)
                    if pen.rep:
                        seen_slot.append(slot)
                        seen_col.append(col)
                    pen.applied = known
                elif known > applied:
                    for token in outputs[applied:known]:
                        self._count(slot, pen, token)
                    pen.applied = known
            if pen.ban and (count < pen.min_tokens) != pen.banning:
                self.apply_outputs(slot, (), count)  # the min_tokens ban switches
            if pen.always or (pen.ban and count < pen.min_tokens):
                table_rows.append(r)
                table_slots.append(slot)

    def _count(self, slot: int, pen: _Penalty, token: int) -> None:
        col = pen.col.get(token)
        if col is None:
            col = int(self.tab_len[slot])
            self.fit_width(col + 1)
            pen.col[token] = col
            self.tab_ids[slot, col] = token
            self.tab_counts[slot, col] = 0
            self.tab_seen[slot, col] = False
            self.tab_bias[slot, col] = 0.0
            self.tab_len[slot] = col + 1
        if pen.count_outputs:
            self._bumps[0].append(slot)
            self._bumps[1].append(col)
        if pen.rep:
            self._seen[0].append(slot)
            self._seen[1].append(col)

    def flush(self) -> None:
        """Writes the page entries, counts and seen flags deferred by slot() and _count (before
        the rows are read, and before a released slot is reused)."""
        slots, cols, pages = self._entries
        if slots:
            self.pages[slots, cols] = pages
            self._entries = ([], [], [])
        slots, cols = self._bumps
        if slots:
            np.add.at(self.tab_counts, (np.array(slots, np.int64), np.array(cols, np.int64)), 1)
            self._bumps = ([], [])
        slots, cols = self._seen
        if slots:
            self.tab_seen[np.array(slots, np.int64), np.array(cols, np.int64)] = True
            self._seen = ([], [])

    def draft_extension(self, slot: int, extra: Seq[int]) -> list[tuple[int, int]]:
        """(column, token) entries a row would gain by also counting `extra` (a draft row samples
        after its earlier drafts): existing columns for known ids, new ones after tab_len."""
        pen = self.penalty[slot]
        if not pen.track:
            return []
        out, new = [], {}
        n = int(self.tab_len[slot])
        for token in extra:
            col = pen.col.get(token, new.get(token))
            if col is None:
                col = new[token] = n + len(new)
            out.append((col, token))
        return out

    # ---- growth --------------------------------------------------------------------------------

    def _grow_rows(self, rows: int) -> None:
        old = len(self.penalty)
        if rows <= old:
            return
        grow = lambda a, fill: np.concatenate([a, np.full((rows - old, *a.shape[1:]), fill, a.dtype)])  # noqa: E731
        self.pages = grow(self.pages, 0)
        self.params = {k: grow(a, PARAMS[k][1]) for k, a in self.params.items()}
        self.seed_words = grow(self.seed_words, 0)
        self.tab_ids, self.tab_counts = grow(self.tab_ids, -1), grow(self.tab_counts, 0)
        self.tab_seen, self.tab_bias = grow(self.tab_seen, False), grow(self.tab_bias, 0.0)
        self.tab_len = grow(self.tab_len, 0)
        self.penalty.extend([None] * (rows - old))
        self.penalized.extend([False] * (rows - old))
        self._free.extend(range(rows - 1, max(old, 1) - 1, -1))  # lowest slots first; never EMPTY_ROW

    def fit_width(self, width: int) -> None:
        have = self.tab_ids.shape[1]
        if width <= have:
            return
        new = max(width, 2 * have, 64)
        pad = lambda a, fill: np.concatenate([a, np.full((a.shape[0], new - have), fill, a.dtype)], axis=1)  # noqa: E731
        self.tab_ids, self.tab_counts = pad(self.tab_ids, -1), pad(self.tab_counts, 0)
        self.tab_seen, self.tab_bias = pad(self.tab_seen, False), pad(self.tab_bias, 0.0)
