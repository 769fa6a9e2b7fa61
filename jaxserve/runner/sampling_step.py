"""A step's sampler inputs gathered from the persistent rows (batch_rows.py): which token rows
sample (logits_index) and their SamplingTensors, equal to SamplingTensors.from_rows over the same
rows' whole histories. A chunk with d drafts samples d + 1 rows; draft row j samples as if the
drafts before it had been emitted, so its output count, min_tokens ban and penalty table include
them (patched into the step's copy of the row, never into the row itself). A decode whose
previous token is still in flight (async scheduling) counts it too, on the device: the row says
where its id is (pending_row), sampler.count_in_flight."""

from __future__ import annotations

import numpy as np

from jaxserve.core.buckets import history_bucket
from jaxserve.core.step_plan import DecodeRows, ScheduledChunk
from jaxserve.runner.batch_rows import EMPTY_ROW, PARAMS, BatchRows
from jaxserve.runner.sampling_tensors import SamplingTensors


def sampling_step(rows: BatchRows, decodes: DecodeRows, decode_slots: list[int],
                  sampling: list[tuple[int, int, ScheduledChunk]], num_rows: int,
                  prev_row: np.ndarray) -> tuple[np.ndarray, SamplingTensors]:
    """decodes: the plan's steady decodes (sample row i = token row i), in row slots decode_slots;
    sampling: (token row just past the chunk, its row slot, chunk) of each other sampling chunk in
    plan order; prev_row: the step's [T] prev_sample_row (where an in-flight token's id is). Returns
    ([num_rows] int32 logits_index, SamplingTensors padded to num_rows)."""
    logits_index = np.zeros(num_rows, np.int32)
    nd = len(decodes)
    slots: list[int] = decode_slots[:]
    num_out: list[int] = decodes.num_outputs[:]
    token_row: list[int] = list(range(nd))
    t = _Tables()
    if nd:
        rows.apply_decodes(decodes, decode_slots, prev_row, t.rows, t.slots, t.pending, t.pending_src)
    penalized, penalty = rows.penalized, rows.penalty
    for end, slot, c in sampling:
        drafts = c.draft_token_ids
        k = 1 + len(drafts)
        count = c.start_pos + len(c.token_ids) - k + 1 - len(c.request.prompt_token_ids)
        r = len(slots)
        if penalized[slot]:
            outputs, pen = c.output_token_ids, penalty[slot]
            if pen.track and count > len(outputs):
                if count > len(outputs) + 1 or k > 1 or prev_row[end - 1] < 0:
                    raise ValueError(f"{c.seq_id!r} samples with penalties over {count - len(outputs)} "
                                     "output token(s) the previous step did not sample")
                t.pending.append(r)  # counted on the device
                t.pending_src.append(int(prev_row[end - 1]))
            rows.apply_outputs(slot, outputs, count)
            for j in range(k):
                if (j == 0 and pen.always) or rows.table_active(slot, count + j):
                    if j:  # a draft row: the drafts before it are patched into its copy of the table
                        t.drafted.append((len(t.rows), slot, count + j, drafts[:j]))
                    t.rows.append(r + j)
                    t.slots.append(slot)
        if k == 1:
            slots.append(slot)
            num_out.append(count)
            token_row.append(end - 1)
        else:
            slots.extend([slot] * k)
            num_out.extend(range(count, count + k))
            token_row.extend(range(end - k, end))
    n = len(slots)
    if n > num_rows:
        raise ValueError(f"{n} sampling rows do not fit the row bucket {num_rows}")
    logits_index[:n] = token_row
    # every array is one gather of rows, the padding rows reading EMPTY_ROW (no scatter into a filled array)
    idx = np.full(num_rows, EMPTY_ROW, np.int64)
    idx[:n] = slots
    padded = {name: rows.params[name][idx] for name in PARAMS}
    words = rows.seed_words[idx]
    outs = np.zeros(num_rows, np.int32)
    outs[:n] = num_out
    pending_row = np.full(num_rows, -1, np.int32)
    if t.pending:
        pending_row[t.pending] = t.pending_src
    ids, counts, seen, bias = _tables(rows, t, num_rows)
    return logits_index, SamplingTensors(
        padded["temperature"], padded["top_k"], padded["top_p"], padded["min_p"], padded["repetition_penalty"],
        padded["presence_penalty"], padded["frequency_penalty"], words, outs, padded["num_logprobs"],
        ids, counts, seen, bias, padded["constrained"], pending_row)


class _Tables:
    """The step's sample rows whose penalty / bias table is active, as parallel lists."""

    __slots__ = ("rows", "slots", "drafted", "pending", "pending_src")

    def __init__(self) -> None:
        self.rows: list[int] = []        # sample rows with an active table, ascending
        self.slots: list[int] = []       # their row slots
        # draft rows among them: (index into rows, slot, outputs before it, drafts before it)
        self.drafted: list[tuple[int, int, int, list[int]]] = []
        self.pending: list[int] = []     # penalty rows whose last output is in flight (counted on the device)
        self.pending_src: list[int] = []  # the previous step's sample row of that output


def _tables(rows: BatchRows, t: _Tables, num_rows: int) -> tuple[np.ndarray, ...]:
    """[num_rows, H] ids / output counts / seen / bias of the rows whose table is active (H the
    declared width that holds the widest, with a free column for a row whose token is in flight;
    0 when none is active)."""
    if not t.rows:
        return _empty_tables(num_rows, history_bucket(0, rows.vocab_size))
    r_idx = np.array(t.rows, np.int64)
    s_idx = np.array(t.slots, np.int64)
    width = rows.tab_len[s_idx]  # [len(t.rows)] columns each row's table uses
    if t.pending:  # a column for the in-flight token
        mark = np.zeros(num_rows, np.int64)
        mark[t.pending] = 1
        width = width + mark[r_idx]
    extensions = [rows.draft_extension(slot, drafts) for _, slot, _, drafts in t.drafted]
    for (i, slot, _, _), ext in zip(t.drafted, extensions):
        have = rows.tab_len[slot]
        width[i] += len({c for c, _ in ext if c >= have})
    h = history_bucket(int(width.max()), rows.vocab_size)
    rows.fit_width(h)
    rows.flush()
    src = np.full(num_rows, EMPTY_ROW, np.int64)  # the rows without an active table read the empty one
    src[r_idx] = s_idx
    ids, counts, seen, bias = (rows.tab_ids[src, :h], rows.tab_counts[src, :h], rows.tab_seen[src, :h],
                               rows.tab_bias[src, :h])
    for (i, slot, num_outputs, _), ext in zip(t.drafted, extensions):
        r = t.rows[i]
        pen = rows.penalty[slot]
        for col, token in ext:
            ids[r, col] = token
            if pen.count_outputs:
                counts[r, col] += 1
            if rows.params["repetition_penalty"][slot] != 1.0:
                seen[r, col] = True
        if pen.banning and num_outputs >= pen.min_tokens:  # the drafts before this row end the ban
            for token in pen.ban:
                bias[r, pen.col[token]] = pen.bias.get(token, 0.0)
    return ids, counts, seen, bias


def _empty_tables(num_rows: int, h: int) -> tuple[np.ndarray, ...]:
    """[num_rows, h] ids (-1) / counts / seen / bias of rows without a table."""
    return (np.full((num_rows, h), -1, np.int32), np.zeros((num_rows, h), np.int32),
            np.zeros((num_rows, h), bool), np.zeros((num_rows, h), np.float32))
