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
from jaxserve.core.step_plan import ScheduledChunk
from jaxserve.runner.batch_rows import PARAMS, BatchRows
from jaxserve.runner.sampling_tensors import SamplingTensors


def sampling_step(rows: BatchRows, sampling: list[tuple[int, int, ScheduledChunk]], num_rows: int,
                  prev_row: np.ndarray) -> tuple[np.ndarray, SamplingTensors]:
    """sampling: (token row just past the chunk, its row slot, chunk) of each sampling chunk in plan
    order; prev_row: the step's [T] prev_sample_row (where an in-flight token's id is). Returns
    ([num_rows] int32 logits_index, SamplingTensors padded to num_rows)."""
    logits_index = np.zeros(num_rows, np.int32)
    slots: list[int] = []
    num_out: list[int] = []
    token_row: list[int] = []
    tables: list[tuple[int, int, int, list[int]]] = []  # (sample row, slot, outputs before it, drafts before it)
    pending: list[tuple[int, int]] = []                 # (sample row, previous step's row of its in-flight token)
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
                pending.append((r, int(prev_row[end - 1])))  # counted on the device
            rows.apply_outputs(slot, outputs, count)
            if k == 1 and pen.always:  # the usual row: a table every step
                tables.append((r, slot, count, drafts))
            else:
                tables.extend((r + j, slot, count + j, drafts[:j]) for j in range(k)
                              if rows.table_active(slot, count + j))
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
    idx = np.array(slots, np.int64)
    padded = {}
    for name, (dtype, fill) in PARAMS.items():
        a = np.full(num_rows, fill, dtype)
        a[:n] = rows.params[name][idx]
        padded[name] = a
    words = np.zeros((num_rows, 2), np.uint32)
    words[:n] = rows.seed_words[idx]
    outs = np.zeros(num_rows, np.int32)
    outs[:n] = num_out
    pending_row = np.full(num_rows, -1, np.int32)
    if pending:
        at, row = zip(*pending)
        pending_row[list(at)] = row
    ids, counts, seen, bias = _tables(rows, tables, num_rows, {r for r, _ in pending})
    return logits_index, SamplingTensors(
        padded["temperature"], padded["top_k"], padded["top_p"], padded["min_p"], padded["repetition_penalty"],
        padded["presence_penalty"], padded["frequency_penalty"], words, outs, padded["num_logprobs"],
        ids, counts, seen, bias, padded["constrained"], pending_row)


def _tables(rows: BatchRows, tables: list[tuple[int, int, int, list[int]]], num_rows: int,
            pending: set[int]) -> tuple[np.ndarray, ...]:
    """[num_rows, H] ids / output counts / seen / bias of the rows whose table is active (H the
    declared width that holds the widest, with a free column for a row whose token is in flight
    (`pending`); 0 when none is active)."""
    if not tables:
        return _empty_tables(num_rows, history_bucket(0, rows.vocab_size))
    r_idx = np.array([t[0] for t in tables], np.int64)
    s_idx = np.array([t[1] for t in tables], np.int64)
    width = rows.tab_len[s_idx]  # [len(tables)] columns each row's table uses
    if pending:  # a column for the in-flight token
        mark = np.zeros(num_rows, np.int64)
        mark[list(pending)] = 1
        width = width + mark[r_idx]
    extensions = [rows.draft_extension(slot, drafts) if drafts else [] for _, slot, _, drafts in tables]
    for i, ext in enumerate(extensions):
        if ext:
            have = rows.tab_len[tables[i][1]]
            width[i] += len({c for c, _ in ext if c >= have})
    h = history_bucket(int(width.max()), rows.vocab_size)
    ids, counts, seen, bias = _empty_tables(num_rows, h)
    rows.fit_width(h)
    rows.flush()
    ids[r_idx] = rows.tab_ids[s_idx, :h]
    counts[r_idx] = rows.tab_counts[s_idx, :h]
    seen[r_idx] = rows.tab_seen[s_idx, :h]
    bias[r_idx] = rows.tab_bias[s_idx, :h]
    for (r, slot, num_outputs, drafts), ext in zip(tables, extensions):
        if not drafts:
            continue
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
