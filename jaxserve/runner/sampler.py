"""Batched sampling with per-row parameters, jitted inside the step.

Every per-row parameter is array data in `SamplingTensors`, so changing values (temperature, top-k,
seed, penalties, ...) never recompiles. The only things that select a compiled variant are shapes:
the row bucket R, the logits width V, and the width H of the per-row token table below.

Pipeline per row (the contract's order):
  grammar bitmask (structured output; constrained rows only): disallowed tokens -> -inf
  vocab padding columns (>= vocab_size) -> -inf
  (constrained rows skip min_tokens' stop/EOS ban below: the grammar alone decides where they end)
  logit bias -> repetition penalty -> presence/frequency penalties      (one gather/scatter of H)
  temperature (rows with temperature 0 -- or below 1e-5, set to 0 by from_rows -- are greedy and
  use 1 here; top_k >= vocab_size is stored as 0 = off)
  -> logprobs = log_softmax of these processed logits: the distribution AFTER penalties and
     temperature but BEFORE top-k/top-p/min-p truncation, for the chosen token and a sorted top-20
  top-k, then top-p renormalised over the top-k set, then min-p (relative to the max probability)
  -> inverse-CDF draw (one uniform from the row's key, one cumulative sum over V); greedy rows
     take the argmax of the processed logits.

Seeds and the penalty/bias token table are built on the host: sampling_tensors.py.

Penalty/bias token table (bounded and cheap): instead of a dense [R, V] count matrix, the host
builds for each row the sorted set of distinct token ids that need touching -- prompt+output tokens
when repetition_penalty != 1, output tokens when a presence/frequency penalty is set, logit_bias
keys, and (while len(output) < min_tokens) the stop/EOS ids, which get a -inf bias -- padded to
`[R, H]` with id -1. Per entry: its output count, whether it occurred in prompt+output (`seen`,
for the repetition penalty) and its bias. The device gathers the H logits, applies all three
adjustments elementwise, and scatters them back: O(R*H) work, with H a power of two >= 64 from
`history_buckets`, and H = 0 (no gather at all) when no row in the batch needs the table. The
distinct-id count is bounded by the context length plus the bias/stop limits, and by V.

Top-k / top-p without a sort (V is 151,936 for Qwen): the k-th largest logit and the top-p cutoff
are both "the largest threshold T whose kept mass (count, or probability) still reaches the
target". We find T exactly by building it bit by bit over an order-preserving uint32 key of the
float logits: 32 passes, each a fused compare+select+row-sum reading [R, V] once (R*V*4 bytes per
pass; 256 rows of 151,936 is ~155 MB, so a memory-bound estimate is ~1-2 ms per search on an
H200 -- not yet measured), versus a segmented sort of R rows of 151,936 (bitonic on GPU/TPU:
O(V log^2 V) per row) or a `lax.top_k` with a large k (which falls back to a sort). Each search
runs under `lax.cond` only when some row in the batch enables it, so
batches without top-k/top-p pay nothing. Ties at the threshold are all kept (as transformers'
`logits < kth_value` masking does). The draw needs one uniform per row (Gumbel-max would need R*V
threefry draws, which dominated a CPU step); the top-20 logprobs
(`lax.top_k`, k=20) also run under `lax.cond`, only when some row asked for alternatives.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxserve.runner.sampling_tensors import PRNG_IMPL, NUM_TOP_LOGPROBS, SamplingTensors

_DRAW_BLOCK = 128                   # columns per block of the two-level CDF in _draw


class SamplerOutput(NamedTuple):
    token_ids: jax.Array       # [R] int32
    logprobs: jax.Array        # [R] f32   logprob of token_ids under the processed distribution
    top_ids: jax.Array         # [R, 20] int32  sorted by logprob desc; -1 where fewer real tokens
    top_logprobs: jax.Array    # [R, 20] f32    -inf where top_ids is -1


# ---------------------------------------------------------------------------------------------
# device side


def _check_shapes(logits: jax.Array, t: SamplingTensors, vocab_size: int) -> None:
    if logits.ndim != 2:
        raise ValueError(f"logits must be [R, V], got shape {logits.shape}")
    if logits.shape[0] != t.num_rows:
        raise ValueError(f"logits have {logits.shape[0]} rows, sampling tensors {t.num_rows}")
    if not 0 < vocab_size <= logits.shape[1]:
        raise ValueError(f"vocab_size {vocab_size} must be in [1, logits width {logits.shape[1]}]")


def bitmask_words(vocab_size: int) -> int:
    """Width of a token bitmask: one int32 word per 32 token ids (llguidance's layout)."""
    return -(-vocab_size // 32)


def apply_bitmask(x: jax.Array, bitmask: jax.Array | None, constrained: jax.Array,
                  vocab_size: int | None = None) -> jax.Array:
    """Tokens whose bit is 0 in a constrained row's [R, W] int32 mask -> -inf (bit j of word w is
    token 32 w + j); unconstrained rows pass through. The unpacking runs under `lax.cond`, only in
    batches with a constrained row. Columns past the mask, and from `vocab_size` on, are never
    allowed.

    Each column reads its word by index and shifts, all elementwise over [R, V]: on TPU a
    [R, W, 32] unpacking (32 on the lane axis) is relaid out and kept as temporaries (3.7x the
    logits' bytes at 256 rows of a 151,936 vocabulary against 1.7x this way).

    Neither branch of the cond returns x unchanged (the vocabulary cut is done in both): a branch
    that passes its operand through makes XLA copy the [R, V] logits, once there and once more at
    the entry of every program that holds such a cond, whether or not the branch runs."""
    col = jnp.arange(x.shape[1], dtype=jnp.int32)
    in_vocab = col[None, :] < (x.shape[1] if vocab_size is None else vocab_size)        # [1, V]
    if bitmask is None:
        return x if vocab_size is None else jnp.where(in_vocab, x, -jnp.inf)
    return jax.lax.cond(jnp.any(constrained),
                        lambda: jnp.where(in_vocab & _allowed(x.shape[1], bitmask, constrained), x, -jnp.inf),
                        lambda: jnp.where(in_vocab, x, -jnp.inf))


def _allowed(vocab: int, bitmask: jax.Array, constrained: jax.Array) -> jax.Array:
    """[R, vocab] bool: apply_bitmask's allowed tokens, computed unconditionally."""
    num_words = bitmask.shape[1]
    col = jnp.arange(vocab, dtype=jnp.int32)
    words = jnp.take(bitmask, jnp.minimum(col >> 5, num_words - 1), axis=1)             # [R, V]
    bits = jax.lax.shift_right_logical(words, (col & 31)[None, :]) & 1
    return ((bits != 0) & (col < 32 * num_words)[None, :]) | ~constrained[:, None]


def process_logits(logits: jax.Array, t: SamplingTensors, vocab_size: int,
                   bitmask: jax.Array | None = None) -> jax.Array:
    """[R, V] logits -> [R, V] f32 after the grammar's bitmask, vocab mask, bias, penalties and
    temperature (greedy: 1)."""
    _check_shapes(logits, t, vocab_size)
    x = apply_bitmask(logits.astype(jnp.float32), bitmask, t.constrained, vocab_size)
    if t.needs_history:
        x = _apply_table(x, t)
    temp = jnp.where(t.temperature > 0, t.temperature, 1.0)
    return x / temp[:, None]


def count_in_flight(t: SamplingTensors, prev_ids: jax.Array) -> SamplingTensors:
    """The tables with each row's in-flight output token counted (async scheduling: the previous
    step sampled it, the host has not seen its id). prev_ids: [W] int32, the previous step's
    sampled ids. The id goes in its column if the row has it, else in the row's first free one, and
    counts as the host counts an output token once it knows it (sampling_step.py, batch_rows.py)."""
    has = t.pending_row >= 0                                                         # [R]
    token = prev_ids[jnp.maximum(t.pending_row, 0)]                                  # [R]
    hit = t.table_ids == token[:, None]                                              # [R, H]
    free = jnp.sum(t.table_ids >= 0, axis=1)                                         # ids fill the first columns
    col = jnp.where(jnp.any(hit, axis=1), jnp.argmax(hit, axis=1), free)
    at = (jnp.arange(t.table_ids.shape[1])[None, :] == col[:, None]) & has[:, None]  # [R, H]
    counted = (t.presence_penalty != 0.0) | (t.frequency_penalty != 0.0)
    return t._replace(table_ids=jnp.where(at, token[:, None], t.table_ids),
                      table_output_counts=t.table_output_counts + (at & counted[:, None]).astype(jnp.int32),
                      table_seen=t.table_seen | (at & (t.repetition_penalty != 1.0)[:, None]))


def _apply_table(x: jax.Array, t: SamplingTensors) -> jax.Array:
    """Bias -> repetition penalty -> presence/frequency on the [R, H] table entries."""
    width = x.shape[1]
    valid = t.table_ids >= 0
    g = jnp.take_along_axis(x, jnp.where(valid, t.table_ids, 0), axis=1)           # [R, H]
    g = g + t.table_bias
    rep = t.repetition_penalty[:, None]
    g = jnp.where(t.table_seen, jnp.where(g > 0, g / rep, g * rep), g)
    counts = t.table_output_counts.astype(jnp.float32)
    g = g - (t.presence_penalty[:, None] * (counts > 0) + t.frequency_penalty[:, None] * counts)
    rows = jnp.arange(x.shape[0], dtype=jnp.int32)[:, None]
    # Ids are distinct within a row; pad entries point past the row and are dropped.
    return x.at[rows, jnp.where(valid, t.table_ids, width)].set(g, mode="drop")


def _order_key(x: jax.Array) -> jax.Array:
    """f32 -> uint32 whose unsigned order is the float order (-0.0 folded onto +0.0)."""
    bits = jax.lax.bitcast_convert_type(jnp.where(x == 0, 0.0, x), jnp.uint32)
    negative = (bits >> 31) == 1
    return jnp.where(negative, ~bits, bits | jnp.uint32(0x8000_0000))


def _largest_threshold(keys: jax.Array, weights: jax.Array, target: jax.Array) -> jax.Array:
    """Per row the largest uint32 T with sum(weights[keys >= T]) >= target ([R, V], [R, V], [R]).

    The kept mass only shrinks as T grows, so T can be built greedily from the top bit down:
    32 fused [R, V] compare+sum passes. If even T = 0 misses the target (float round-off near a
    target equal to the total), T stays 0 and everything is kept.
    """
    def body(i, thr):
        cand = thr | jnp.left_shift(jnp.uint32(1), (31 - i).astype(jnp.uint32))
        mass = jnp.sum(jnp.where(keys >= cand[:, None], weights, 0.0), axis=1)
        return jnp.where(mass >= target, cand, thr)

    return jax.lax.fori_loop(0, 32, body, jnp.zeros(keys.shape[0], jnp.uint32))


def _truncation_mask(x: jax.Array, t: SamplingTensors) -> jax.Array:
    """[R, V] bool: tokens that survive top-k, then top-p over the top-k set, then min-p."""
    row_max = jnp.max(x, axis=1, keepdims=True)
    # min-p: p / p_max >= min_p  <=>  x - x_max >= log(min_p); unaffected by renormalisation.
    keep = (x - row_max) >= jnp.log(t.min_p)[:, None]

    k_on = t.top_k > 0
    p_on = t.top_p < 1.0
    # One cond around both searches: a batch without top-k/top-p materialises no all-ones masks.
    return jax.lax.cond(jnp.any(k_on | p_on), lambda: keep & _top_k_p_mask(x, t, row_max, k_on, p_on), lambda: keep)


def _top_k_p_mask(x: jax.Array, t: SamplingTensors, row_max: jax.Array, k_on: jax.Array,
                  p_on: jax.Array) -> jax.Array:
    """[R, V] bool: tokens inside the top-k set, then inside the top-p mass of that set."""
    keys = _order_key(x)

    def top_k_mask(_):
        thr = _largest_threshold(keys, jnp.ones_like(x), t.top_k.astype(jnp.float32))
        return ~k_on[:, None] | (keys >= thr[:, None])

    keep_k = jax.lax.cond(jnp.any(k_on), top_k_mask, lambda _: jnp.ones(x.shape, bool), None)

    def top_p_mask(_):
        e = jnp.where(keep_k, jnp.exp(x - row_max), 0.0)   # unnormalised probs over the top-k set
        target = t.top_p * jnp.sum(e, axis=1)
        thr = _largest_threshold(keys, e, target)
        return ~p_on[:, None] | (keys >= thr[:, None])

    keep_p = jax.lax.cond(jnp.any(p_on), top_p_mask, lambda _: jnp.ones(x.shape, bool), None)
    return keep_k & keep_p


def _row_keys(t: SamplingTensors) -> jax.Array:
    base = jax.random.wrap_key_data(t.seed_words, impl=PRNG_IMPL)                 # [R] keys
    return jax.vmap(jax.random.fold_in)(base, t.num_output_tokens)


def _top_logprobs(x: jax.Array, lse: jax.Array, t: SamplingTensors, vocab_size: int):
    """Top-20 of the log-softmax x - lse ([R, V], [R]), only when some row asked for alternatives."""
    r, width = x.shape
    k = NUM_TOP_LOGPROBS

    def compute(_):
        lp = x - lse[:, None]
        if width < k:  # tiny vocabularies: pad so top_k has k columns to pick from
            lp = jnp.pad(lp, ((0, 0), (0, k - width)), constant_values=-jnp.inf)
        vals, ids = jax.lax.top_k(lp, k)
        # Padding columns and tokens a grammar forbids hold -inf: they only fill the tail, as -1.
        real = (ids < vocab_size) & (vals > -jnp.inf)
        return jnp.where(real, ids, -1).astype(jnp.int32), jnp.where(real, vals, -jnp.inf)

    def skip(_):
        return jnp.full((r, k), -1, jnp.int32), jnp.full((r, k), -jnp.inf, jnp.float32)

    return jax.lax.cond(jnp.any(t.num_logprobs > 0), compute, skip, None)


def draw_uniform(t: SamplingTensors) -> jax.Array:
    """[R] float32 in [0, 1): one uniform per row from the row's own key."""
    return jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(_row_keys(t))


def _draw(x: jax.Array, t: SamplingTensors, row_max: jax.Array) -> jax.Array:
    """Inverse-CDF draw over the truncated distribution with one uniform per row (Gumbel-max
    would need R*V threefry draws, which dominated a CPU step). The CDF is two-level, block sums
    of `_DRAW_BLOCK` columns then one block, because a flat cumsum over V lowers to a slow scan."""
    r, v = x.shape
    e = jnp.where(_truncation_mask(x, t), jnp.exp(x - row_max), 0.0)            # [R, V]
    pad = (-v) % _DRAW_BLOCK
    blocks = jnp.pad(e, ((0, 0), (0, pad))).reshape(r, -1, _DRAW_BLOCK)           # [R, NB, B]
    block_cdf = jnp.cumsum(jnp.sum(blocks, axis=2), axis=1)                       # [R, NB]
    u = draw_uniform(t) * block_cdf[:, -1]
    # First block whose cumulative mass exceeds u, then the first column inside it likewise.
    b = jnp.minimum(jnp.sum(block_cdf <= u[:, None], axis=1), block_cdf.shape[1] - 1)
    before = jnp.where(b > 0, jnp.take_along_axis(block_cdf, jnp.maximum(b - 1, 0)[:, None], axis=1)[:, 0], 0.0)
    inner = jnp.cumsum(jnp.take_along_axis(blocks, b[:, None, None], axis=1)[:, 0], axis=1)  # [R, B]
    col = jnp.minimum(jnp.sum(inner <= (u - before)[:, None], axis=1), _DRAW_BLOCK - 1)
    return jnp.minimum(b * _DRAW_BLOCK + col, v - 1).astype(jnp.int32)


def argmax_rows(x: jax.Array, block: int = _DRAW_BLOCK) -> jax.Array:
    """jnp.argmax(x, axis=1) for x: [R, V], the same index on ties (the first); for a row with NaN
    the index is unspecified (XLA's vectorised max may drop NaNs; a NaN check would cost more than
    the whole argmax). The maximum of each block of `block` columns, the first
    block holding the row's maximum, then the argmax inside that block: XLA's CPU argmax is a
    (value, index) reduction it does not vectorise (21 ms for 64 x 151,936 on the benchmark CPU,
    against under 1 ms for this two-level form)."""
    r, v = x.shape
    pad = (-v) % block
    blocks = jnp.pad(x, ((0, 0), (0, pad)), constant_values=-jnp.inf).reshape(r, -1, block)   # [R, NB, B]
    best_block = jnp.argmax(jnp.max(blocks, axis=2), axis=1)                                    # [R]
    inside = jnp.take_along_axis(blocks, best_block[:, None, None], axis=1)[:, 0]              # [R, B]
    return (best_block * block + jnp.argmax(inside, axis=1)).astype(jnp.int32)


def _greedy_ids(logits: jax.Array, t: SamplingTensors, vocab_size: int, bitmask: jax.Array | None) -> jax.Array:
    """[R] argmax of the processed logits of greedy rows. Dividing by a positive temperature keeps
    the argmax, so only the vocabulary cut and the table (bias, penalties) matter; slicing off the
    padding columns instead of masking them keeps the argmax a plain reduction over the logits
    (fused with a mask it runs ~20x slower on a CPU)."""
    def ids(mask: bool) -> jax.Array:
        x = logits[:, :vocab_size].astype(jnp.float32)
        if mask:
            x = jnp.where(_allowed(x.shape[1], bitmask, t.constrained), x, -jnp.inf)
        if t.needs_history:
            x = _apply_table(x, t)
        return argmax_rows(x)

    if bitmask is None:
        return ids(False)
    # The cond yields ids (see apply_bitmask); unconstrained batches skip the mask altogether.
    return jax.lax.cond(jnp.any(t.constrained), lambda: ids(True), lambda: ids(False))


def sample(logits: jax.Array, tensors: SamplingTensors, vocab_size: int,
           bitmask: jax.Array | None = None) -> SamplerOutput:
    """Sample one token per row. logits: [R, V] (V may exceed vocab_size: padding columns);
    bitmask: [R, bitmask_words(vocab_size)] int32 allowed-token bits of constrained rows, or None.

    Jittable with `vocab_size` static; parameter values are data, so they never recompile.
    Cost for an all-greedy batch without logprobs: the processed logits and one argmax pass; the
    normaliser (logsumexp), the truncation masks, the draw and the top-20 run under `lax.cond`
    only when a row needs them. `logprobs` is 0 for rows that did not ask for logprobs.
    """
    def processed() -> jax.Array:  # [R, V]; recomputed inside each branch so that an all-greedy
        return process_logits(logits, tensors, vocab_size, bitmask)  # batch never materialises it

    r = logits.shape[0]
    greedy_ids = jax.lax.cond(jnp.any(tensors.temperature == 0),
                              lambda: _greedy_ids(logits, tensors, vocab_size, bitmask),
                              lambda: jnp.zeros(r, jnp.int32))

    def draw() -> jax.Array:
        x = processed()
        return _draw(x, tensors, jnp.max(x, axis=1, keepdims=True))

    sampled_ids = jax.lax.cond(jnp.any(tensors.temperature > 0), draw, lambda: jnp.zeros(r, jnp.int32))
    token_ids = jnp.where(tensors.temperature > 0, sampled_ids, greedy_ids)
    # The normaliser costs an exp over [R, V]; only batches with a row that wants logprobs pay it.
    wants = tensors.num_logprobs >= 0

    def logprobs() -> tuple[jax.Array, jax.Array, jax.Array]:
        x = processed()
        lse = jax.nn.logsumexp(x, axis=1)
        chosen = jnp.take_along_axis(x, token_ids[:, None], axis=1)[:, 0] - lse
        return (chosen, *_top_logprobs(x, lse, tensors, vocab_size))

    def no_logprobs() -> tuple[jax.Array, jax.Array, jax.Array]:
        return (jnp.zeros(r, jnp.float32), jnp.full((r, NUM_TOP_LOGPROBS), -1, jnp.int32),
                jnp.full((r, NUM_TOP_LOGPROBS), -jnp.inf, jnp.float32))

    chosen, top_ids, top_lps = jax.lax.cond(jnp.any(wants), logprobs, no_logprobs)
    chosen = jnp.where(wants, chosen, 0.0)
    return SamplerOutput(token_ids, chosen, top_ids, top_lps)
