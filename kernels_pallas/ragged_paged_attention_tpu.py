"""Ragged paged attention as a TPU Pallas (Mosaic) kernel.

Layout and schedule:
  * grid = (number of q blocks,): block `b` owns token rows [b*BQ, (b+1)*BQ) for every head.
    q is re-laid out by the wrapper as [KVH, T*G, D] (row r = token*G + g), so one kv head's
    queries are a plain 2-D [BQ*G, D] tile: GQA is a matmul over the group, not a gather.
  * scalar prefetch (SMEM): seq_lens, cu_q_lens, flattened page tables, num_seqs, and for each
    q block the first sequence with a row in it (computed by the wrapper with searchsorted).
  * K/V pages stay in HBM (`memory_space=pl.ANY`). The kernel walks the (sequence, kv block)
    pairs that touch its q rows in one flat while loop, DMA-ing whole pages
    [ps, KVH, D] into a two-slot VMEM buffer: the copy of the next pair (possibly the next
    sequence) is started before the current one is computed, so transfers overlap compute.
  * online softmax in float32 scratch (m, l lane-replicated to 128, acc [KVH, BQ*G, D]); a row
    only changes while its own sequence is walked, because every other row is fully masked.

Tested on CPU through the TPU interpreter (`interpret=True`) and through Pallas' Mosaic lowering
(`lowering_platforms=("tpu",)`); it has not been compiled by libtpu yet. The one construct most
likely to need rework there is the per-head read `k_buf[slot, :, :, h, :]`: with the pinned
[P, ps, KVH, D] page layout one head is a single sublane row of each [KVH, D] tile, which Mosaic
must relayout into a dense [NPB*ps, D] operand. If it refuses, fetch per (page, head) into a
head-major buffer, or move the KV cache to a head-major / K-V-interleaved layout.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas._checks import MASK_VALUE, check_attention_args, check_block_arg, is_power_of_two
from kernels_pallas.ragged_paged_attention_reference import row_to_seq

_LANES = 128


def _kernel(
    # scalar prefetch (SMEM)
    seq_lens_ref,  # [S] int32
    cu_q_lens_ref,  # [S + 1] int32
    tables_ref,  # [S * MP] int32, row-major page tables
    num_seqs_ref,  # [1] int32
    first_seq_ref,  # [NQB] int32, first sequence with a row in q block b (num_seqs if none)
    # inputs
    q_ref,  # [KVH, BQ*G, D] VMEM block
    k_hbm,  # [P, ps, KVH, D] HBM
    v_hbm,  # [P, ps, KVH, D] HBM
    # output
    o_ref,  # [KVH, BQ*G, D] VMEM block
    # scratch
    k_buf,  # [2, NPB, ps, KVH, D]
    v_buf,  # [2, NPB, ps, KVH, D]
    sems,  # DMA semaphores [2 (k, v), 2 (slot)]
    m_ref,  # [KVH, BQ*G, 128] f32 running max, lane-replicated
    l_ref,  # [KVH, BQ*G, 128] f32 running denominator, lane-replicated
    acc_ref,  # [KVH, BQ*G, D] f32 running numerator
    *,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    block_q: int,
    group: int,
    max_pages: int,
):
    num_kv_heads, rows, head_dim = acc_ref.shape
    _, pages_per_block, page_size, _, _ = k_buf.shape
    num_pages = k_hbm.shape[0]
    block_kv = pages_per_block * page_size
    max_seqs = seq_lens_ref.shape[0]
    b = pl.program_id(0)
    row0 = b * block_q  # first token row of this q block
    row_end = row0 + block_q
    num_seqs = num_seqs_ref[0]

    m_ref[...] = jnp.full(m_ref.shape, MASK_VALUE, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    def has_rows(s):  # sequence s exists and starts before this block ends
        s_safe = jnp.minimum(s, max_seqs)
        return (s < num_seqs) & (cu_q_lens_ref[s_safe] < row_end)

    def kv_block_range(s):
        """[start, end) kv blocks that rows of sequence s inside this q block can see (>= 1 block)."""
        s = jnp.minimum(s, max_seqs - 1)
        q_start, q_end = cu_q_lens_ref[s], cu_q_lens_ref[s + 1]
        ctx0 = seq_lens_ref[s] - (q_end - q_start)  # position of the sequence's first q row
        lo = jnp.maximum(q_start, row0)
        hi = jnp.minimum(q_end, row_end)
        max_pos = jnp.maximum(ctx0 + hi - 1 - q_start, 0)
        if sliding_window is None:
            start = jnp.int32(0)
        else:
            min_pos = ctx0 + lo - q_start
            start = lax.div(jnp.maximum(min_pos - sliding_window + 1, 0), block_kv)
        end = jnp.maximum(lax.div(max_pos, block_kv) + 1, start + 1)
        return start, end

    def page_copies(s, kb, slot):
        """(is a real page, K copy, V copy) for each page of kv block kb of sequence s."""
        num_seq_pages = lax.div(seq_lens_ref[s] + page_size - 1, page_size)
        copies = []
        for i in range(pages_per_block):
            j = kb * pages_per_block + i
            entry = tables_ref[s * max_pages + jnp.minimum(j, max_pages - 1)]
            page = jnp.clip(entry, 0, num_pages - 1)  # a bad id must not become a bad DMA
            copies.append((
                j < num_seq_pages,
                pltpu.make_async_copy(k_hbm.at[page], k_buf.at[slot, i], sems.at[0, slot]),
                pltpu.make_async_copy(v_hbm.at[page], v_buf.at[slot, i], sems.at[1, slot]),
            ))
        return copies

    def start_fetch(s, kb, slot):
        for real, k_copy, v_copy in page_copies(s, kb, slot):
            @pl.when(real)
            def _():
                k_copy.start()
                v_copy.start()

    def wait_fetch(s, kb, slot):
        for real, k_copy, v_copy in page_copies(s, kb, slot):
            @pl.when(real)
            def _():
                k_copy.wait()
                v_copy.wait()

    def compute(s, kb, slot):
        seq_len = seq_lens_ref[s]
        q_start = cu_q_lens_ref[s]
        q_len = cu_q_lens_ref[s + 1] - q_start
        r = lax.broadcasted_iota(jnp.int32, (rows, block_kv), 0)
        if is_power_of_two(group):
            token = row0 + lax.shift_right_logical(r, group.bit_length() - 1)
        else:
            token = row0 + lax.div(r, group)
        pos = seq_len - q_len + token - q_start  # [rows, BK] absolute position of the query
        kv_pos = kb * block_kv + lax.broadcasted_iota(jnp.int32, (rows, block_kv), 1)
        mask = (token >= q_start) & (token < q_start + q_len) & (kv_pos <= pos)
        if sliding_window is not None:
            mask &= pos - kv_pos < sliding_window
        kv_real = (kb * block_kv + lax.broadcasted_iota(jnp.int32, (block_kv, head_dim), 0)) < seq_len
        for h in range(num_kv_heads):
            # Unfetched / stale slots may hold anything (NaN included): zero them.
            k = k_buf[slot, :, :, h, :].reshape(block_kv, head_dim)
            v = v_buf[slot, :, :, h, :].reshape(block_kv, head_dim)
            k = jnp.where(kv_real, k, jnp.zeros_like(k))
            v = jnp.where(kv_real, v, jnp.zeros_like(v))
            logits = lax.dot_general(
                q_ref[h], k, (((1,), (1,)), ((), ())),
                preferred_element_type=jnp.float32, precision=lax.Precision.HIGHEST,
            ) * sm_scale  # [rows, BK]
            if soft_cap is not None:
                logits = soft_cap * jnp.tanh(logits / soft_cap)
            logits = jnp.where(mask, logits, MASK_VALUE)
            m_prev = m_ref[h, :, 0:1]  # [rows, 1]
            m_new = jnp.maximum(m_prev, logits.max(axis=1, keepdims=True))
            p = jnp.where(mask, jnp.exp(logits - m_new), 0.0)
            alpha = jnp.exp(m_prev - m_new)
            l_new = alpha * l_ref[h, :, 0:1] + p.sum(axis=1, keepdims=True)
            pv = lax.dot_general(
                p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                preferred_element_type=jnp.float32, precision=lax.Precision.HIGHEST,
            )  # [rows, D]
            acc_ref[h] = alpha * acc_ref[h] + pv
            m_ref[h] = jnp.broadcast_to(m_new, (rows, _LANES))
            l_ref[h] = jnp.broadcast_to(l_new, (rows, _LANES))

    def next_pair(s, kb):
        _, end = kv_block_range(s)
        more = kb + 1 < end
        next_start, _ = kv_block_range(s + 1)
        return jnp.where(more, s, s + 1), jnp.where(more, kb + 1, next_start)

    s0 = first_seq_ref[b]
    kb0, _ = kv_block_range(s0)

    @pl.when(has_rows(s0))
    def _():
        start_fetch(jnp.minimum(s0, max_seqs - 1), kb0, 0)

    def body(carry):
        s, kb, slot = carry
        s_next, kb_next = next_pair(s, kb)

        @pl.when(has_rows(s_next))
        def _():
            start_fetch(jnp.minimum(s_next, max_seqs - 1), kb_next, 1 - slot)

        wait_fetch(s, kb, slot)
        compute(s, kb, slot)
        return s_next, kb_next, 1 - slot

    lax.while_loop(lambda c: has_rows(c[0]), body, (s0, kb0, jnp.int32(0)))

    for h in range(num_kv_heads):
        l = l_ref[h, :, 0:1]
        o_ref[h] = (acc_ref[h] / jnp.where(l > 0, l, 1.0)).astype(o_ref.dtype)


def default_block_q(group: int) -> int:
    """Token rows per q block: about 128 matmul rows, a multiple of 16 (bf16 sublane tile)."""
    return max(16, (128 // group) // 16 * 16)


def default_pages_per_block(page_size: int, max_pages: int) -> int:
    """Pages fetched per kv block: about 128 keys."""
    return max(1, min(max_pages, 128 // page_size))


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale", "sliding_window", "soft_cap", "block_q", "pages_per_block", "interpret",
    ),
)
def ragged_paged_attention_tpu(
    q: jax.Array,  # [T, H, D]
    k_pages: jax.Array,  # [P, ps, KVH, D]
    v_pages: jax.Array,  # [P, ps, KVH, D]
    seq_lens: jax.Array,  # [S] int32
    cu_q_lens: jax.Array,  # [S + 1] int32
    page_tables: jax.Array,  # [S, MP] int32
    num_seqs: jax.Array,  # [1] int32
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    block_q: int | None = None,
    pages_per_block: int | None = None,
    interpret: bool = False,
) -> jax.Array:  # [T, H, D]
    """Ragged paged attention on TPU (see docs/CONTRACTS.md); `interpret` runs the TPU interpreter."""
    dims = check_attention_args(
        q, k_pages, v_pages, seq_lens, cu_q_lens, page_tables, num_seqs,
        sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
    )
    check_block_arg("block_q", block_q)
    check_block_arg("pages_per_block", pages_per_block)
    T, H, D = q.shape
    KVH, G, MP, S = dims.num_kv_heads, dims.group, dims.max_pages_per_seq, dims.max_seqs
    bq = block_q or default_block_q(G)
    npb = pages_per_block or default_pages_per_block(dims.page_size, MP)
    num_q_blocks = -(-T // bq)
    t_pad = num_q_blocks * bq

    # [T, H, D] -> [KVH, T_pad * G, D]; padded rows belong to no sequence and come out as 0.
    q_t = jnp.pad(q, ((0, t_pad - T), (0, 0), (0, 0))).reshape(t_pad, KVH, G, D)
    q_t = q_t.transpose(1, 0, 2, 3).reshape(KVH, t_pad * G, D)
    block_starts = jnp.arange(num_q_blocks, dtype=jnp.int32) * bq
    seq_of_block, live = row_to_seq(cu_q_lens, num_seqs, block_starts)
    first_seq = jnp.where(live, seq_of_block, num_seqs[0]).astype(jnp.int32)

    rows = bq * G
    block = pl.BlockSpec((KVH, rows, D), lambda b, *_: (0, b, 0))
    kernel = functools.partial(
        _kernel, sm_scale=float(sm_scale), sliding_window=sliding_window, soft_cap=soft_cap,
        block_q=bq, group=G, max_pages=MP,
    )
    buf = pltpu.VMEM((2, npb, dims.page_size, KVH, D), k_pages.dtype)
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=5,
            grid=(num_q_blocks,),
            in_specs=[block, pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=block,
            scratch_shapes=[
                buf,
                buf,
                pltpu.SemaphoreType.DMA((2, 2)),
                pltpu.VMEM((KVH, rows, _LANES), jnp.float32),
                pltpu.VMEM((KVH, rows, _LANES), jnp.float32),
                pltpu.VMEM((KVH, rows, D), jnp.float32),
            ],
        ),
        out_shape=jax.ShapeDtypeStruct((KVH, t_pad * G, D), q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="ragged_paged_attention_tpu",
    )(seq_lens, cu_q_lens, page_tables.reshape(S * MP), num_seqs, first_seq, q_t, k_pages, v_pages)
    out = out.reshape(KVH, t_pad, G, D).transpose(1, 0, 2, 3).reshape(t_pad, H, D)
    return out[:T]
