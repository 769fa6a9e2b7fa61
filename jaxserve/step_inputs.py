"""StepPlan -> fixed-bucket numpy arrays. The only place that pads.

A step is one flat ragged batch: `T` token rows (a bucket >= the plan's tokens), `S` sequence rows
(a bucket >= the plan's chunks); the rows that sample are gathered before the lm_head, and there
are at most S of them, so the logits/sampling row count is S too. Buckets are declared by the
engine config as (T, S) pairs with S <= T and T <= max_num_batched_tokens, so padding never exceeds
the step's token budget. Padding rows write to the out-of-bounds slot (dropped) and belong to no
live sequence (`num_seqs` stops the attention there).
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np

from jaxserve.config import EngineConfig
from jaxserve.sampler import SamplingRow, SamplingTensors
from jaxserve.scheduler import StepPlan


class StepArrays(NamedTuple):
    token_ids: np.ndarray      # [T] int32
    positions: np.ndarray      # [T] int32
    token_seq: np.ndarray      # [T] int32  sequence row of each token (padding -> 0)
    slot_mapping: np.ndarray   # [T] int32  page * page_size + offset; padding -> num_pages * page_size
    cu_q_lens: np.ndarray      # [S + 1] int32
    seq_lens: np.ndarray       # [S] int32  tokens in the cache after this step
    page_tables: np.ndarray    # [S, max_pages_per_seq] int32
    num_seqs: np.ndarray       # [1] int32
    logits_index: np.ndarray   # [S] int32  token rows that sample (padding -> 0)


class StepInputs(NamedTuple):
    arrays: StepArrays
    sampling: SamplingTensors
    num_samples: int           # leading rows of the sampler output that are real
    copies: np.ndarray         # [C, 2] int32 (src, dst) page copies before the step; may be empty


def declared_buckets(cfg: EngineConfig) -> list[tuple[int, int]]:
    """All (T, S) step shapes the runner compiles at start-up, smallest first."""
    # A step of T tokens has at most T sequences, so sequence buckets above T are capped at T.
    return sorted({(t, min(s, t)) for t in cfg.resolved_token_buckets() for s in cfg.resolved_seq_buckets()})


def choose_bucket(buckets: Sequence[tuple[int, int]], num_tokens: int, num_seqs: int) -> tuple[int, int]:
    fitting = [b for b in buckets if b[0] >= num_tokens and b[1] >= num_seqs]
    if not fitting:
        raise ValueError(f"no declared bucket holds {num_tokens} tokens and {num_seqs} sequences; "
                         f"largest is {max(buckets)}")
    return min(fitting, key=lambda b: (b[0], b[1]))


class StepInputBuilder:
    def __init__(self, cfg: EngineConfig, num_pages: int, vocab_size: int) -> None:
        self.cfg = cfg
        self.num_pages = num_pages
        self.vocab_size = vocab_size
        self.buckets = declared_buckets(cfg)
        self.pad_slot = num_pages * cfg.page_size

    def build(self, plan: StepPlan) -> StepInputs:
        """Every request arrives seeded (the engine draws a seed when the user gave none); sample i
        of a request uses seed + i, so the n samples differ and each is reproducible."""
        chunks = plan.chunks
        t_bucket, s_bucket = choose_bucket(self.buckets, plan.num_tokens, len(chunks))
        ps = self.cfg.page_size
        token_ids = np.zeros(t_bucket, np.int32)
        positions = np.zeros(t_bucket, np.int32)
        token_seq = np.zeros(t_bucket, np.int32)
        slots = np.full(t_bucket, self.pad_slot, np.int32)
        cu = np.zeros(s_bucket + 1, np.int32)
        seq_lens = np.zeros(s_bucket, np.int32)
        page_tables = np.zeros((s_bucket, self.cfg.max_pages_per_seq), np.int32)
        logits_index = np.zeros(s_bucket, np.int32)
        rows: list[SamplingRow] = []
        t = 0
        for i, c in enumerate(chunks):
            n = len(c.token_ids)
            pos = np.arange(c.start_pos, c.start_pos + n, dtype=np.int32)
            table = np.asarray(c.page_table, np.int32)
            token_ids[t:t + n] = c.token_ids
            positions[t:t + n] = pos
            token_seq[t:t + n] = i
            slots[t:t + n] = table[pos // ps] * ps + pos % ps
            page_tables[i, : len(table)] = table
            seq_lens[i] = c.start_pos + n
            t += n
            cu[i + 1] = t
            if c.sample:
                logits_index[len(rows)] = t - 1
                rows.append(SamplingRow(c.request.params, c.request.params.seed + c.sample_index,
                                        c.request.prompt_token_ids, c.output_token_ids,
                                        c.request.eos_token_ids))
        cu[len(chunks) + 1:] = t
        arrays = StepArrays(token_ids, positions, token_seq, slots, cu, seq_lens, page_tables,
                            np.array([len(chunks)], np.int32), logits_index)
        sampling = SamplingTensors.from_rows(rows, s_bucket, self.vocab_size)
        copies = np.asarray(plan.copies, np.int32).reshape(-1, 2)
        return StepInputs(arrays, sampling, len(rows), copies)
