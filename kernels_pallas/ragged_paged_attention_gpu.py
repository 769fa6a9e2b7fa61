"""Ragged paged attention as a GPU Pallas kernel (Triton backend).

Schedule:
  * The wrapper cuts every sequence's q rows into tiles of BQ tokens and lists them as work
    items (sequence, first row, rows in tile, position of first row). A batch has at most
    cdiv(T, BQ) + S tiles, which is the static grid size W; items past the real count are empty.
  * grid = (W, KVH, Gp / HB). Program (w, h, b) loads its q tile for query heads [b HB, (b + 1) HB)
    of kv head h's group as one [BQ*HB, D] matrix (rows token-major, heads minor; Gp = G rounded up
    to a power of two; HB = Gp unless the float32 accumulators [BQ*HB, Dv] would pass
    MAX_ACCUMULATOR_VALUES: MLA's 128 heads of 512 value lanes go to two programs of 64), then walks
    the kv blocks its rows can see (causal end, sliding-window start), gathering each
    block's keys through the page table with a masked pointer gather, with an online softmax in
    float32.
  * A kv block holds BK keys: NPB = BK / page_size whole pages when BK >= page_size, else a slice
    of one page (a 128-token page is read as two 64-key blocks, say), so the block size is chosen
    for shared memory, not dictated by the page size.
  * Decode (q_len = 1) is a one-row tile per sequence; chunked prefill is several tiles; a mixed
    batch is just both kinds of items in one grid.
  * The output is a zero buffer aliased in and written with masked stores, so rows that belong
    to no sequence stay 0.
  * 8-bit pages (int8 / float8, kernels_pallas/kv_quant.py) are widened to q's dtype as they are
    gathered; their per-token scales [P, KVH, ps] f32 are gathered the same way as a [1, BK] row
    that multiplies the logits (K scales) and the probabilities (V scales).
  * Attention sinks (gpt-oss, `sinks` [H] f32): the wrapper lays them out per program row,
    [KVH, Gp / HB, BQ*HB] (row t * HB + j of head block b: sinks[h * G + b * HB + j]); a program's
    running max starts there and its running sum at 1, the sink being a first key with a zero value.
  * Values read from the keys' rows (`v_pages=None`, multi-head latent attention's latent row):
    each key block is gathered once and is both dots' operand, its first Dv lanes the values.

Triton needs power-of-two block shapes and dot operands of at least 16 in each dimension: a row is
read in up to three power-of-two lane parts of at least 16 (`lane_parts`: 576 = 512 + 64, 80 = 64 +
16), the logits summed over the parts' dots and each value part accumulated on its own; page_size
must be a power of two and head_dim at most MAX_HEAD_DIM (`supports()` says whether a shape runs
here; `kernels_pallas.ragged_paged_attention` sends the others to the reference).

Shared memory (measured on sm_90a from the per-kernel figures XLA reports for compile-only H100s,
jax 0.10.2, ~1100 configurations): the kernel keeps the q tile [R, D] and, per pipeline stage, one
K and one V block [BK, D] in shared memory (K alone when the values are the keys' rows), R = block_q
* HB rows; 8-bit pages stage 8-bit blocks plus their widened copy; a few bytes a row go to
reductions, and float32 inputs at IEEE precision (jax's "highest"; the default is TF32 on the
tensor cores) also stage a float32 [R, BK] tile. `gpu_blocks.shared_memory_bytes` adds these up (a
bound the measurements reached within 1%), the default blocks shrink (BK first, down to 16 keys,
then block_q, then the head block) until it fits `MAX_SHARED_MEMORY` (227 KiB per block on
H100/H200), and explicit blocks that do not fit raise ValueError before Triton is reached.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels_pallas._checks import (
    MASK_VALUE,
    check_attention_args,
    check_block_arg,
    is_power_of_two,
    next_power_of_two,
)
from kernels_pallas.gpu_blocks import (
    _MIN_DOT,
    MAX_HEAD_DIM,
    MAX_SHARED_MEMORY,
    choose_blocks,
    lane_parts,
    shared_memory_bytes,
    supports,
    value_parts,
)

# Passing Triton compiler params selects the Triton lowering (newer jax defaults to Mosaic GPU);
# jax < 0.7 named the class TritonCompilerParams.
_TritonParams = getattr(plgpu, "CompilerParams", None) or getattr(plgpu, "TritonCompilerParams")


def _kernel(
    work_seq_ref,  # [W] int32 sequence of work item w
    work_row_ref,  # [W] int32 first token row of the tile
    work_len_ref,  # [W] int32 live rows in the tile (0: empty item)
    work_pos_ref,  # [W] int32 absolute position of the tile's first row
    seq_lens_ref,  # [S] int32
    tables_ref,  # [S, MPp] int32, padded to a multiple of NPB (= max(1, BK / ps))
    q_ref,  # [T + BQ, KVH, Gp, D]
    k_ref,  # [P, ps, KVH, D]
    *refs,  # v_ref [P, ps, KVH, D] unless shared; quantized pages: k_scales (and v_scales unless shared)
    # [P, KVH, ps] f32; sinks: [KVH, Gp / head_block, rows] f32 (a program's rows); then _o_in_ref (aliased), o_ref [T + BQ, KVH, Gp, Dv]
    shared: bool,
    quantized: bool,
    has_sinks: bool,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    block_q: int,
    block_kv: int,
    head_block: int,
    lanes: tuple[tuple[int, int], ...],
    num_value_parts: int,
):
    refs = list(refs)
    v_ref = k_ref if shared else refs.pop(0)
    ks_ref = vs_ref = None
    if quantized:
        ks_ref = refs.pop(0)
        vs_ref = ks_ref if shared else refs.pop(0)
    sinks_ref = refs.pop(0) if has_sinks else None
    o_ref = refs[-1]
    num_pages, page_size, _, _ = k_ref.shape
    rows = block_q * head_block
    # A block is NPB whole pages (BK >= ps) or a BK-key slice of one page (BK < ps).
    pages_per_block = max(1, block_kv // page_size)
    keys_per_page = min(block_kv, page_size)
    w = pl.program_id(0)
    h = pl.program_id(1)
    head_blk = pl.program_id(2)
    g0 = head_blk * head_block  # this program's first q head of kv head h's (padded) group
    n_rows = work_len_ref[w]
    # The key lanes come in power-of-two parts (Triton's block shapes): one part for the usual head
    # sizes, 512 + 64 for a latent row; the values are the first `num_value_parts` parts (of V's rows,
    # or of the keys' own rows when `shared`).
    v_lanes = lanes if not shared else lanes[:num_value_parts]

    @pl.when(n_rows > 0)
    def _():
        s = work_seq_ref[w]
        row0 = work_row_ref[w]
        pos0 = work_pos_ref[w]
        seq_len = seq_lens_ref[s]
        num_seq_pages = (seq_len + page_size - 1) // page_size

        qs = [q_ref[pl.ds(row0, block_q), h, pl.ds(g0, head_block), pl.ds(off, width)].reshape(rows, width)
              for off, width in lanes]  # [rows, width] each
        tile_row = lax.broadcasted_iota(jnp.int32, (rows, block_kv), 0) // head_block
        row_live = tile_row < n_rows
        pos = pos0 + tile_row  # [rows, BK]

        last_pos = pos0 + n_rows - 1
        kb_end = last_pos // block_kv + 1
        if sliding_window is None:
            kb_start = 0
        else:
            kb_start = jnp.maximum(pos0 - sliding_window + 1, 0) // block_kv

        def body(kb, carry):
            m, l, accs = carry  # [rows], [rows], [rows, width] per value part
            first_key = kb * block_kv
            first_page = first_key // page_size
            page_idx = first_page + jnp.arange(pages_per_block, dtype=jnp.int32)
            pages = tables_ref[s, pl.ds(first_page, pages_per_block)]  # [NPB]
            # Entries past the sequence's pages are never read; clip so no id becomes a wild pointer.
            pages = jnp.clip(jnp.where(page_idx < num_seq_pages, pages, 0), 0, num_pages - 1)
            # The block's first slot is first_key mod ps: nonzero only when the block is a slice of a
            # page (written as a subtraction: the Triton lowering rejects jnp's floor-mod of int32).
            first_slot = first_key - first_page * page_size

            def gather(ref, off, width):
                """One lane part of the block's rows, [BK, width] in q's dtype, stale slots 0: a
                pointer gather with every axis indexed by a broadcast array, which both the Triton
                lowering and the interpreter accept."""
                shape3 = (pages_per_block, keys_per_page, width)
                slot = first_slot + lax.broadcasted_iota(jnp.int32, shape3, 1)
                dim = off + lax.broadcasted_iota(jnp.int32, shape3, 2)
                page3 = jnp.broadcast_to(pages[:, None, None], shape3)
                kv_real = (page_idx[:, None, None] * page_size + slot) < seq_len
                if quantized:
                    # 8-bit pages widen exactly to q's dtype; Triton has no int -> float8 cast for a
                    # masked load's fill value, so stale slots are zeroed after widening.
                    x = jnp.where(kv_real, plgpu.load(ref.at[page3, slot, h, dim]).astype(q_ref.dtype), 0.0)
                else:  # stale slots (even NaN) load as 0
                    x = plgpu.load(ref.at[page3, slot, h, dim], mask=kv_real, other=0.0)
                return x.reshape(block_kv, width)

            ks = [gather(k_ref, off, width) for off, width in lanes]
            logits = sum(
                lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
                for q, k in zip(qs, ks)
            ) * sm_scale  # [rows, BK]
            if quantized:
                # Per-key scales [1, BK] (kv_quant.py): on the logits here, on p before the PV dot.
                # Built from iotas, not sliced from the 3-D indices: Triton has no tensor slicing.
                shape2 = (pages_per_block, keys_per_page)
                slot2 = first_slot + lax.broadcasted_iota(jnp.int32, shape2, 1)
                page2 = jnp.broadcast_to(pages[:, None], shape2)
                real2 = (page_idx[:, None] * page_size + slot2) < seq_len
                k_scale = plgpu.load(ks_ref.at[page2, h, slot2], mask=real2, other=0.0).reshape(1, block_kv)
                v_scale = k_scale if shared else plgpu.load(
                    vs_ref.at[page2, h, slot2], mask=real2, other=0.0).reshape(1, block_kv)
                logits = logits * k_scale
            if soft_cap is not None:
                logits = soft_cap * jnp.tanh(logits / soft_cap)
            kv_pos = kb * block_kv + lax.broadcasted_iota(jnp.int32, (rows, block_kv), 1)
            mask = row_live & (kv_pos <= pos)
            if sliding_window is not None:
                mask &= pos - kv_pos < sliding_window
            logits = jnp.where(mask, logits, MASK_VALUE)
            m_new = jnp.maximum(m, logits.max(axis=1))
            p = jnp.where(mask, jnp.exp(logits - m_new[:, None]), 0.0)
            alpha = jnp.exp(m - m_new)
            l_new = alpha * l + p.sum(axis=1)
            p = (p * v_scale if quantized else p).astype(q_ref.dtype)
            vs = ks[:num_value_parts] if shared else [gather(v_ref, off, width) for off, width in v_lanes]
            accs = tuple(
                alpha[:, None] * acc + lax.dot_general(p, v, (((1,), (0,)), ((), ())),
                                                       preferred_element_type=jnp.float32)
                for acc, v in zip(accs, vs)
            )  # [rows, width] each
            return m_new, l_new, accs

        if has_sinks:  # the sink as a first key with a zero value: max = sink, sum = exp(0) = 1
            m0, l0 = sinks_ref[h, head_blk, :], jnp.ones((rows,), jnp.float32)
        else:
            m0, l0 = jnp.full((rows,), MASK_VALUE, jnp.float32), jnp.zeros((rows,), jnp.float32)
        init = (m0, l0, tuple(jnp.zeros((rows, width), jnp.float32) for _, width in v_lanes))
        _, l, accs = lax.fori_loop(kb_start, kb_end, body, init)
        for (off, width), acc in zip(v_lanes, accs):
            out = (acc / jnp.where(l > 0, l, 1.0)[:, None]).reshape(block_q, head_block, width)
            live = lax.broadcasted_iota(jnp.int32, (block_q, head_block, width), 0) < n_rows
            plgpu.store(o_ref.at[pl.ds(row0, block_q), h, pl.ds(g0, head_block), pl.ds(off, width)],
                        out.astype(o_ref.dtype), mask=live)


def work_items(
    cu_q_lens: jax.Array,  # [S + 1] int32
    seq_lens: jax.Array,  # [S] int32
    num_seqs: jax.Array,  # [1] int32
    *,
    block_q: int,
    num_items: int,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Tiles of <= block_q rows per sequence: (seq, first row, live rows, first position), each [W]."""
    max_seqs = seq_lens.shape[0]
    live_seq = jnp.arange(max_seqs, dtype=jnp.int32) < num_seqs[0]
    q_len = jnp.where(live_seq, jnp.maximum(cu_q_lens[1:] - cu_q_lens[:-1], 0), 0)
    tiles = (q_len + block_q - 1) // block_q
    tiles_end = jnp.cumsum(tiles).astype(jnp.int32)  # [S]
    w = jnp.arange(num_items, dtype=jnp.int32)
    seq = jnp.searchsorted(tiles_end, w, side="right").astype(jnp.int32)
    real = seq < max_seqs
    seq = jnp.minimum(seq, max_seqs - 1)
    tile = w - (tiles_end[seq] - tiles[seq])
    first_row = cu_q_lens[seq] + tile * block_q
    n_rows = jnp.where(real, jnp.clip(q_len[seq] - tile * block_q, 0, block_q), 0)
    first_pos = seq_lens[seq] - q_len[seq] + tile * block_q
    return seq, jnp.where(real, first_row, 0), n_rows.astype(jnp.int32), first_pos


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale", "sliding_window", "soft_cap", "block_q", "block_kv",
        "num_warps", "num_stages", "interpret", "v_head_dim",
    ),
)
def ragged_paged_attention_gpu(
    q: jax.Array,  # [T, H, D]
    k_pages: jax.Array,  # [P, ps, KVH, D]
    v_pages: jax.Array | None,  # [P, ps, KVH, D], or None: the values are K's rows (v_head_dim lanes)
    seq_lens: jax.Array,  # [S] int32
    cu_q_lens: jax.Array,  # [S + 1] int32
    page_tables: jax.Array,  # [S, MP] int32
    num_seqs: jax.Array,  # [1] int32
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    block_q: int | None = None,
    block_kv: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 2,
    interpret: bool = False,
    k_scales: jax.Array | None = None,  # [P, KVH, ps] float32 for quantized pages (kv_quant.py)
    v_scales: jax.Array | None = None,
    sinks: jax.Array | None = None,  # [H] float32: one value-less logit per q head (gpt-oss)
    v_head_dim: int | None = None,
) -> jax.Array:  # [T, H, Dv]
    """Ragged paged attention on GPU (see docs/CONTRACTS.md); `interpret` runs on any backend.

    Tuning knobs (static, powers of two; None picks a default that fits shared memory):
    `block_q` token rows per q tile, `block_kv` keys per kv block (whole pages when it is at least
    the page size, else a slice of one page), Triton's `num_warps` and `num_stages`.
    """
    dims = check_attention_args(
        q, k_pages, v_pages, seq_lens, cu_q_lens, page_tables, num_seqs,
        sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
        k_scales=k_scales, v_scales=v_scales, sinks=sinks, v_head_dim=v_head_dim,
    )
    for name, value in (("block_q", block_q), ("block_kv", block_kv), ("num_warps", num_warps),
                        ("num_stages", num_stages)):
        check_block_arg(name, value)
    shared = v_pages is None
    T, H, D = q.shape
    Dv = dims.v_head_dim
    if not supports(head_dim=D, page_size=dims.page_size, v_head_dim=Dv):
        raise ValueError(
            f"GPU kernel needs a head_dim of at most {MAX_HEAD_DIM} made of one to three power-of-two parts "
            f"of at least {_MIN_DOT} lanes, values ending on a part, and a power-of-two page_size; got "
            f"head_dim={D}, v_head_dim={Dv}, page_size={dims.page_size}"
        )
    KVH, G, S, MP = dims.num_kv_heads, dims.group, dims.max_seqs, dims.max_pages_per_seq
    ps = dims.page_size
    gp = next_power_of_two(G)
    for name, value in (("block_q", block_q), ("block_kv", block_kv)):
        if value is not None and not is_power_of_two(value):
            raise ValueError(f"{name} must be a power of two, got {value}")
    itemsize = jnp.dtype(q.dtype).itemsize
    page_itemsize = jnp.dtype(k_pages.dtype).itemsize
    bq, bk, hb = choose_blocks(
        num_tokens=T, max_seqs=S, group_p=gp, head_dim=D, page_size=ps, itemsize=itemsize,
        num_stages=num_stages, block_q=block_q, block_kv=block_kv, v_head_dim=Dv, shared=shared,
        page_itemsize=page_itemsize,
    )
    npb = max(1, bk // ps)
    rows = bq * hb
    if not interpret:
        if rows < _MIN_DOT or bk < _MIN_DOT:
            raise ValueError(
                f"block_q * heads ({rows}) and block_kv ({bk} keys) must be >= {_MIN_DOT} "
                f"for Triton dots"
            )
        smem = shared_memory_bytes(block_q=bq, group_p=hb, block_kv=bk, head_dim=D, itemsize=itemsize,
                                   num_stages=num_stages, kv_blocks=1 if shared else 2, page_itemsize=page_itemsize)
        if smem > MAX_SHARED_MEMORY:
            layout = (f"{bk // ps} pages of {ps} keys" if bk >= ps
                      else f"a 1/{ps // bk} slice of a {ps}-key page")
            raise ValueError(
                f"GPU kernel blocks need ~{smem} bytes of shared memory, more than the "
                f"{MAX_SHARED_MEMORY} one block may use (sm_90): block_q={bq}, block_kv={bk} "
                f"({layout}), num_stages={num_stages}, with group={G} (padded to {gp}, {hb} heads a "
                f"program), head_dim={D}, dtype={jnp.dtype(q.dtype).name}; use a smaller block_q, "
                f"block_kv or num_stages"
            )
    num_items = -(-T // bq) + S
    work = work_items(cu_q_lens, seq_lens, num_seqs, block_q=bq, num_items=num_items)

    # Pad rows so every tile slice [row0, row0 + BQ) is in bounds, heads so G is a power of two,
    # and the page table so every kv block slice is in bounds.
    q_p = q.reshape(T, KVH, G, D)
    q_p = jnp.pad(q_p, ((0, bq), (0, 0), (0, gp - G), (0, 0)))
    mp_pad = -(-MP // npb) * npb
    tables = jnp.pad(page_tables, ((0, 0), (0, mp_pad - MP)))
    out_init = jnp.zeros((T + bq, KVH, gp, Dv), q.dtype)

    parts = lane_parts(D)
    kernel = functools.partial(
        _kernel, sm_scale=float(sm_scale), sliding_window=sliding_window, soft_cap=soft_cap,
        block_q=bq, block_kv=bk, head_block=hb, lanes=parts, num_value_parts=value_parts(D, Dv),
        shared=shared, quantized=k_scales is not None, has_sinks=sinks is not None,
    )
    warps = num_warps or (4 if rows <= 64 and rows * Dv <= 64 * 256 else 8)
    pages = (k_pages,) if shared else (k_pages, v_pages)
    scales = () if k_scales is None else (k_scales,) if shared else (k_scales, v_scales)
    # sinks per program row [KVH, Gp / hb, BQ * hb] (row t * hb + j of head block b: sinks[h * G + b * hb + j]);
    # padded heads get 0 (their rows are never stored)
    sink_rows = () if sinks is None else (jnp.broadcast_to(
        jnp.pad(sinks.reshape(KVH, G), ((0, 0), (0, gp - G))).reshape(KVH, gp // hb, 1, hb),
        (KVH, gp // hb, bq, hb)).reshape(KVH, gp // hb, rows),)
    operands = (*work, seq_lens, tables, q_p, *pages, *scales, *sink_rows, out_init)
    out = pl.pallas_call(
        kernel,
        grid=(num_items, KVH, gp // hb),
        out_shape=jax.ShapeDtypeStruct(out_init.shape, q.dtype),
        input_output_aliases={len(operands) - 1: 0},
        compiler_params=_TritonParams(num_warps=warps, num_stages=num_stages),
        interpret=interpret,
        name="ragged_paged_attention_gpu",
    )(*operands)
    return out[:T, :, :G, :].reshape(T, H, Dv)
