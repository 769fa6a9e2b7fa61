"""The from-scratch form of StepInputBuilder.build: every array rebuilt from each chunk's whole page
table and each sampling row's whole history (SamplingTensors.from_rows). The persistent rows
(runner/batch_rows.py) must give the same step; tests/test_batch_rows.py holds them to this."""

from __future__ import annotations

import numpy as np

from jaxserve.core.buckets import choose_bucket, choose_logits_rows
from jaxserve.core.step_plan import PENDING_TOKEN, StepPlan
from jaxserve.runner.sampling_tensors import SamplingRow, SamplingTensors
from jaxserve.runner.step_inputs import (EagleShift, StepArrays, StepInputBuilder, StepInputs, _shift_chunk,
                                         row_that_sampled, sampler_spans)


def needs_output_ids(params) -> bool:
    """Whether sampling a row reads its output token ids (not only their count)."""
    return params.repetition_penalty != 1.0 or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0


def outputs_before_sample(c, in_flight: dict[str, int]) -> list[int]:
    """The output tokens before the one chunk c samples: the live list, then the in-flight one
    (async scheduling) from `in_flight` (seq_id -> the id the previous step sampled) when known,
    else -1 (only its count matters then; a row with penalties must know it)."""
    count = c.start_pos + len(c.token_ids) - len(c.draft_token_ids) - len(c.request.prompt_token_ids)
    live = list(c.output_token_ids)
    if count == len(live):
        return live
    assert count == len(live) + 1, (c.seq_id, count, len(live))
    if c.seq_id in in_flight:
        return live + [in_flight[c.seq_id]]
    assert not needs_output_ids(c.request.params), f"{c.seq_id}: the in-flight id of a penalty row is needed"
    return live + [-1]


def rebuild(builder: StepInputBuilder, plan: StepPlan, prev_plan: StepPlan | None = None,
            in_flight: dict[str, int] | None = None) -> StepInputs:
    """builder's step for `plan`, built from scratch (builder's config and buckets; none of its
    rows); in_flight: the ids of in-flight tokens (what the device knows), see outputs_before_sample."""
    cfg = builder.cfg
    chunks = plan.chunks
    t_bucket, s_bucket = choose_bucket(builder.buckets, plan.num_tokens, len(chunks))
    l_bucket = choose_logits_rows(cfg, t_bucket, s_bucket, plan.num_samples)
    ps = cfg.page_size
    token_ids = np.zeros(t_bucket, np.int32)
    positions = np.zeros(t_bucket, np.int32)
    token_seq = np.zeros(t_bucket, np.int32)
    slots = np.full(t_bucket, builder.pad_slot, np.int32)
    cu = np.zeros(s_bucket + 1, np.int32)
    seq_lens = np.zeros(s_bucket, np.int32)
    width = cfg.max_pages_per_seq
    page_tables = np.zeros((s_bucket, builder.num_groups * width), np.int32)  # every layer group's table
    logits_index = np.zeros(l_bucket, np.int32)
    prev_row = np.full(t_bucket, -1, np.int32)
    lora_slot = np.full(t_bucket, -1, np.int32) if cfg.enable_lora else None
    shift = EagleShift(np.zeros(t_bucket, np.int32), np.full(t_bucket, -1, np.int32)) if builder.eagle else None
    prev_spans = None
    rows: list[SamplingRow] = []
    t = 0
    for i, c in enumerate(chunks):
        n = len(c.token_ids)
        pos = np.arange(c.start_pos, c.start_pos + n, dtype=np.int32)
        table = np.asarray(c.page_table, np.int32)
        token_ids[t:t + n] = c.token_ids
        if lora_slot is not None:
            lora_slot[t:t + n] = c.lora_slot
        if c.token_ids[-1] == PENDING_TOKEN:
            if prev_spans is None:
                prev_spans = sampler_spans(prev_plan)
            row = row_that_sampled(prev_spans, c) if prev_spans.get(c.seq_id, (0, 0, 0))[2] == 1 else None
            if row is None:
                raise ValueError(f"{c.seq_id!r} decodes a pending token that the previous step did not sample")
            token_ids[t + n - 1] = 0
            prev_row[t + n - 1] = row
        positions[t:t + n] = pos
        token_seq[t:t + n] = i
        slots[t:t + n] = table[pos // ps] * ps + pos % ps
        for g, group_table in enumerate(c.group_page_tables or [c.page_table]):
            page_tables[i, g * width: g * width + len(group_table)] = group_table
        seq_lens[i] = c.start_pos + n
        if shift is not None:
            _shift_chunk(shift, t, c, plan, len(rows))
        t += n
        cu[i + 1] = t
        if c.sample:
            outputs = outputs_before_sample(c, in_flight or {})
            for j in range(c.num_sample_rows):
                logits_index[len(rows)] = t - c.num_sample_rows + j
                rows.append(SamplingRow(c.request.params, c.request.params.seed + c.sample_index,
                                        c.request.prompt_token_ids,
                                        [*outputs, *c.draft_token_ids[:j]] if j else outputs,
                                        c.request.eos_token_ids, c.request.grammar is not None))
    cu[len(chunks) + 1:] = t
    arrays = StepArrays(token_ids, positions, token_seq, slots, cu, seq_lens, page_tables,
                        np.array([len(chunks)], np.int32), logits_index, prev_row, lora_slot)
    sampling = SamplingTensors.from_rows(rows, l_bucket, builder.vocab_size)
    copies = np.asarray(plan.copies, np.int32).reshape(-1, 2)
    return StepInputs(arrays, sampling, len(rows), copies, shift)
