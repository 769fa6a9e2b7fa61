"""The sampler's per-row inputs built on the host: each row's parameters (SamplingRow) -> SamplingTensors,
arrays padded to the row bucket R, so changing a value never recompiles. Seeds: a row's key is
`fold_in(key(seed), num_output_tokens)` with the threefry2x32 PRNG fixed here, the 64-bit seed
split into its two 32-bit words as `jax.random.key(seed)` does under x64. The penalty/bias token
table [R, H] (sorted distinct ids a row touches, padded with -1; H from `history_buckets`, 0 when
no row needs it) is built here; sampler.py says how the device applies it."""

from __future__ import annotations

from typing import NamedTuple, Sequence

import jax
import numpy as np

from jaxserve.core.buckets import history_bucket
from jaxserve.core.sampling_params import MAX_LOGPROBS, SamplingParams

NUM_TOP_LOGPROBS = MAX_LOGPROBS     # width of SamplerOutput.top_ids / top_logprobs
GREEDY_TEMPERATURE = 1e-5           # temperatures below this are treated as greedy (avoids inf/inf)
PADDING_TEMPERATURE = -1.0          # marks the bucket's padding rows: neither greedy nor sampled
PRNG_IMPL = "threefry2x32"


class SamplingRow(NamedTuple):
    """What `from_rows` needs to know about one sequence to be sampled."""

    params: SamplingParams
    seed: int
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    eos_token_ids: frozenset[int] = frozenset()  # banned with stop_token_ids until min_tokens
    constrained: bool = False                    # a grammar's token bitmask applies to this row


def seed_words(seed: int) -> tuple[int, int]:
    """(hi, lo) uint32 words of a 64-bit two's-complement seed, as threefry_seed splits it."""
    u = seed & 0xFFFF_FFFF_FFFF_FFFF
    return u >> 32, u & 0xFFFF_FFFF


def _row_table(row: SamplingRow, vocab_size: int) -> tuple[np.ndarray, ...] | None:
    """Sorted distinct ids and per id (output count, seen in prompt+output, bias); None if none."""
    p = row.params
    use_rep = p.repetition_penalty != 1.0
    use_pf = p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
    bias = dict(p.logit_bias or {})
    if len(row.output_token_ids) < p.min_tokens and not row.constrained:  # a grammar decides its own end
        banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(row.eos_token_ids))
        bias.update({t: -np.inf for t in banned})
    if not (use_rep or use_pf or bias):
        return None
    out = np.asarray(row.output_token_ids, np.int64).reshape(-1)
    prompt = np.asarray(row.prompt_token_ids, np.int64).reshape(-1) if use_rep else out[:0]
    if not (use_rep or use_pf):
        out = out[:0]
    bias_ids = np.fromiter(bias.keys(), np.int64, len(bias))
    every = np.concatenate([prompt, out, bias_ids])
    if every.size and (every.min() < 0 or every.max() >= vocab_size):
        raise ValueError(f"token ids of a sampling row must be in [0, {vocab_size})")
    ids = np.unique(every)
    counts = np.zeros(ids.size, np.int32)
    seen = np.zeros(ids.size, bool)
    biases = np.zeros(ids.size, np.float32)
    if use_pf and out.size:
        u, c = np.unique(out, return_counts=True)
        counts[np.searchsorted(ids, u)] = c
    if use_rep:
        seen[np.searchsorted(ids, np.unique(np.concatenate([prompt, out])))] = True
    if bias:
        biases[np.searchsorted(ids, bias_ids)] = np.fromiter(bias.values(), np.float32, len(bias))
    return ids, counts, seen, biases


class SamplingTensors(NamedTuple):
    """Per-row sampling parameters as arrays; leading dim R is the row bucket. A pytree."""

    temperature: jax.Array         # [R] f32, 0 => greedy, PADDING_TEMPERATURE => a padding row
    top_k: jax.Array               # [R] i32, 0 => off
    top_p: jax.Array               # [R] f32, 1 => off
    min_p: jax.Array               # [R] f32, 0 => off
    repetition_penalty: jax.Array  # [R] f32
    presence_penalty: jax.Array    # [R] f32
    frequency_penalty: jax.Array   # [R] f32
    seed_words: jax.Array          # [R, 2] uint32, threefry key data (hi, lo) of the row's seed
    num_output_tokens: jax.Array   # [R] i32, folded into the key
    num_logprobs: jax.Array        # [R] i32, alternatives wanted (0: chosen-token logprob only; -1: no logprobs)
    table_ids: jax.Array           # [R, H] i32, distinct ids to adjust, -1 = pad
    table_output_counts: jax.Array # [R, H] i32, occurrences among output tokens
    table_seen: jax.Array          # [R, H] bool, occurs in prompt+output (repetition penalty)
    table_bias: jax.Array          # [R, H] f32, logit bias (-inf bans)
    constrained: jax.Array         # [R] bool, the row's bitmask applies (structured output)
    # Async scheduling with a penalty table: the row's latest output token is still in flight (its
    # id is the previous step's sample at this row of its output; -1: none). The sampler counts it
    # into the table (sampler.count_in_flight): in its column if the id is there, else in the first
    # unused one (a row's ids fill its first columns).
    pending_row: jax.Array         # [R] i32

    @property
    def num_rows(self) -> int:
        return self.temperature.shape[0]

    @property
    def needs_history(self) -> bool:
        """Static (shape-derived): False when no row needs penalties or bias, so no gather runs."""
        return self.table_ids.shape[1] > 0

    @classmethod
    def from_rows(cls, rows: Sequence[SamplingRow | tuple], num_rows: int,
                  vocab_size: int) -> "SamplingTensors":
        """Host-side (numpy) build; rows past len(rows) are neutral padding (no penalty; marked by
        PADDING_TEMPERATURE, so a batch of sampled rows never pays for a greedy pass, nor greedy
        rows for a draw, because of them; their token is 0)."""
        if len(rows) > num_rows:
            raise ValueError(f"{len(rows)} sampling rows do not fit the row bucket {num_rows}")
        rows = [r if isinstance(r, SamplingRow) else SamplingRow(*r) for r in rows]
        f32 = lambda fill: np.full(num_rows, fill, np.float32)  # noqa: E731
        temperature, top_p, min_p = f32(PADDING_TEMPERATURE), f32(1.0), f32(0.0)
        rep, presence, frequency = f32(1.0), f32(0.0), f32(0.0)
        top_k = np.zeros(num_rows, np.int32)
        words = np.zeros((num_rows, 2), np.uint32)
        num_out = np.zeros(num_rows, np.int32)
        num_logprobs = np.full(num_rows, -1, np.int32)
        constrained = np.zeros(num_rows, bool)
        tables: list[tuple[int, tuple[np.ndarray, ...]]] = []
        for i, row in enumerate(rows):
            p = row.params
            if row.seed is None:
                raise ValueError(f"sampling row {i} has no seed (the engine seeds every row)")
            temperature[i] = 0.0 if p.temperature < GREEDY_TEMPERATURE else p.temperature
            top_k[i] = p.top_k if 0 < p.top_k < vocab_size else 0
            top_p[i], min_p[i] = p.top_p, p.min_p
            rep[i], presence[i], frequency[i] = (p.repetition_penalty, p.presence_penalty,
                                                 p.frequency_penalty)
            words[i] = seed_words(row.seed)
            num_out[i] = len(row.output_token_ids)
            num_logprobs[i] = -1 if p.logprobs is None else p.logprobs
            constrained[i] = row.constrained
            table = _row_table(row, vocab_size)
            if table is not None:
                tables.append((i, table))
        h = history_bucket(max((t[0].size for _, t in tables), default=0), vocab_size)
        table_ids = np.full((num_rows, h), -1, np.int32)
        table_counts = np.zeros((num_rows, h), np.int32)
        table_seen = np.zeros((num_rows, h), bool)
        table_bias = np.zeros((num_rows, h), np.float32)
        for i, (ids, counts, seen, biases) in tables:
            n = ids.size
            table_ids[i, :n], table_counts[i, :n] = ids, counts
            table_seen[i, :n], table_bias[i, :n] = seen, biases
        return cls(temperature, top_k, top_p, min_p, rep, presence, frequency, words, num_out,
                   num_logprobs, table_ids, table_counts, table_seen, table_bias, constrained,
                   np.full(num_rows, -1, np.int32))
