"""Ragged paged attention as a GPU Pallas kernel (Triton backend).

Schedule:
  * The wrapper cuts every sequence's q rows into tiles of BQ tokens and lists them as work
    items (sequence, first row, rows in tile, position of first row). A batch has at most
    cdiv(T, BQ) + S tiles, which is the static grid size W; items past the real count are empty.
  * grid = (W, KVH). Program (w, h) loads its q tile for the G query heads of kv head h as one
    [BQ*Gp, D] matrix (rows token-major, GQA group minor; Gp = G rounded up to a power of two),
    then walks the kv blocks its rows can see (causal end, sliding-window start), gathering
    NPB pages per block through the page table with a masked pointer gather, with an online
    softmax in float32.
  * Decode (q_len = 1) is a one-row tile per sequence; chunked prefill is several tiles; a mixed
    batch is just both kinds of items in one grid.
  * The output is a zero buffer aliased in and written with masked stores, so rows that belong
    to no sequence stay 0.

Triton needs power-of-two block shapes and dot operands of at least 16 in each dimension:
head_dim and page_size must be powers of two (`supports()` says whether a shape runs here).
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

_MIN_DOT = 16
# Passing Triton compiler params selects the Triton lowering (newer jax defaults to Mosaic GPU);
# jax < 0.7 named the class TritonCompilerParams.
_TritonParams = getattr(plgpu, "CompilerParams", None) or getattr(plgpu, "TritonCompilerParams")


def _kernel(
    work_seq_ref,  # [W] int32 sequence of work item w
    work_row_ref,  # [W] int32 first token row of the tile
    work_len_ref,  # [W] int32 live rows in the tile (0: empty item)
    work_pos_ref,  # [W] int32 absolute position of the tile's first row
    seq_lens_ref,  # [S] int32
    tables_ref,  # [S, MPp] int32, padded to a multiple of NPB
    q_ref,  # [T + BQ, KVH, Gp, D]
    k_ref,  # [P, ps, KVH, D]
    v_ref,  # [P, ps, KVH, D]
    _o_in_ref,  # aliased with o_ref
    o_ref,  # [T + BQ, KVH, Gp, D]
    *,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    block_q: int,
    pages_per_block: int,
):
    _, _, group_p, head_dim = q_ref.shape
    num_pages, page_size, _, _ = k_ref.shape
    rows = block_q * group_p
    block_kv = pages_per_block * page_size
    w = pl.program_id(0)
    h = pl.program_id(1)
    n_rows = work_len_ref[w]

    @pl.when(n_rows > 0)
    def _():
        s = work_seq_ref[w]
        row0 = work_row_ref[w]
        pos0 = work_pos_ref[w]
        seq_len = seq_lens_ref[s]
        num_seq_pages = (seq_len + page_size - 1) // page_size

        q = q_ref[pl.ds(row0, block_q), h, :, :].reshape(rows, head_dim)  # [rows, D]
        tile_row = lax.broadcasted_iota(jnp.int32, (rows, block_kv), 0) // group_p
        row_live = tile_row < n_rows
        pos = pos0 + tile_row  # [rows, BK]

        last_pos = pos0 + n_rows - 1
        kb_end = last_pos // block_kv + 1
        if sliding_window is None:
            kb_start = 0
        else:
            kb_start = jnp.maximum(pos0 - sliding_window + 1, 0) // block_kv

        def body(kb, carry):
            m, l, acc = carry  # [rows], [rows], [rows, D]
            page_idx = kb * pages_per_block + jnp.arange(pages_per_block, dtype=jnp.int32)
            pages = tables_ref[s, pl.ds(kb * pages_per_block, pages_per_block)]  # [NPB]
            # Entries past the sequence's pages are never read; clip so no id becomes a wild pointer.
            pages = jnp.clip(jnp.where(page_idx < num_seq_pages, pages, 0), 0, num_pages - 1)
            # Pointer gather [NPB, ps, D]: every axis indexed by a broadcast array, which both
            # the Triton lowering and the interpreter accept.
            shape3 = (pages_per_block, page_size, head_dim)
            slot = lax.broadcasted_iota(jnp.int32, shape3, 1)
            dim = lax.broadcasted_iota(jnp.int32, shape3, 2)
            page3 = jnp.broadcast_to(pages[:, None, None], shape3)
            kv_real = (page_idx[:, None, None] * page_size + slot) < seq_len
            # Stale slots (even NaN) load as 0.
            k = plgpu.load(k_ref.at[page3, slot, h, dim], mask=kv_real, other=0.0)
            v = plgpu.load(v_ref.at[page3, slot, h, dim], mask=kv_real, other=0.0)
            k = k.reshape(block_kv, head_dim)
            v = v.reshape(block_kv, head_dim)

            logits = lax.dot_general(
                q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
            ) * sm_scale  # [rows, BK]
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
            pv = lax.dot_general(
                p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                preferred_element_type=jnp.float32,
            )  # [rows, D]
            return m_new, l_new, alpha[:, None] * acc + pv

        init = (
            jnp.full((rows,), MASK_VALUE, jnp.float32),
            jnp.zeros((rows,), jnp.float32),
            jnp.zeros((rows, head_dim), jnp.float32),
        )
        _, l, acc = lax.fori_loop(kb_start, kb_end, body, init)
        out = acc / jnp.where(l > 0, l, 1.0)[:, None]
        out = out.reshape(block_q, group_p, head_dim).astype(o_ref.dtype)
        live = (
            lax.broadcasted_iota(jnp.int32, (block_q, group_p, head_dim), 0) < n_rows
        )
        plgpu.store(o_ref.at[pl.ds(row0, block_q), h, :, :], out, mask=live)


def supports(*, head_dim: int, page_size: int) -> bool:
    """Whether this kernel handles these sizes (Triton block shapes are powers of two)."""
    return is_power_of_two(head_dim) and head_dim >= _MIN_DOT and is_power_of_two(page_size)


def default_block_q(num_tokens: int, max_seqs: int, group_p: int) -> int:
    """Decode-heavy buckets (T <= 2S) get 16-row tiles, prefill buckets 64-row tiles."""
    target_rows = _MIN_DOT if num_tokens <= 2 * max_seqs else 64
    return max(1, target_rows // group_p)


def default_pages_per_block(page_size: int) -> int:
    """About 64 keys per kv block, never fewer than 16 (the Triton dot minimum)."""
    return max(1, 64 // page_size)


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
        "sm_scale", "sliding_window", "soft_cap", "block_q", "pages_per_block",
        "num_warps", "num_stages", "interpret",
    ),
)
def ragged_paged_attention_gpu(
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
    num_warps: int | None = None,
    num_stages: int = 2,
    interpret: bool = False,
) -> jax.Array:  # [T, H, D]
    """Ragged paged attention on GPU (see docs/CONTRACTS.md); `interpret` runs on any backend."""
    dims = check_attention_args(
        q, k_pages, v_pages, seq_lens, cu_q_lens, page_tables, num_seqs,
        sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
    )
    for name, value in (("block_q", block_q), ("pages_per_block", pages_per_block),
                        ("num_warps", num_warps), ("num_stages", num_stages)):
        check_block_arg(name, value)
    if not supports(head_dim=dims.head_dim, page_size=dims.page_size):
        raise ValueError(
            f"GPU kernel needs a power-of-two head_dim >= {_MIN_DOT} and a power-of-two "
            f"page_size; got head_dim={dims.head_dim}, page_size={dims.page_size}"
        )
    T, H, D = q.shape
    KVH, G, S, MP = dims.num_kv_heads, dims.group, dims.max_seqs, dims.max_pages_per_seq
    gp = next_power_of_two(G)
    bq = block_q or default_block_q(T, S, gp)
    npb = pages_per_block or default_pages_per_block(dims.page_size)
    for name, value in (("block_q", bq), ("pages_per_block", npb)):
        if not is_power_of_two(value):
            raise ValueError(f"{name} must be a power of two, got {value}")
    if not interpret and (bq * gp < _MIN_DOT or npb * dims.page_size < _MIN_DOT):
        raise ValueError(
            f"block_q * group ({bq * gp}) and pages_per_block * page_size "
            f"({npb * dims.page_size}) must be >= {_MIN_DOT} for Triton dots"
        )
    num_items = -(-T // bq) + S
    work = work_items(cu_q_lens, seq_lens, num_seqs, block_q=bq, num_items=num_items)

    # Pad rows so every tile slice [row0, row0 + BQ) is in bounds, heads so G is a power of two,
    # and the page table so every kv block slice is in bounds.
    q_p = q.reshape(T, KVH, G, D)
    q_p = jnp.pad(q_p, ((0, bq), (0, 0), (0, gp - G), (0, 0)))
    mp_pad = -(-MP // npb) * npb
    tables = jnp.pad(page_tables, ((0, 0), (0, mp_pad - MP)))
    out_init = jnp.zeros_like(q_p)

    kernel = functools.partial(
        _kernel, sm_scale=float(sm_scale), sliding_window=sliding_window, soft_cap=soft_cap,
        block_q=bq, pages_per_block=npb,
    )
    warps = num_warps or (4 if bq * gp <= 64 else 8)
    out = pl.pallas_call(
        kernel,
        grid=(num_items, KVH),
        out_shape=jax.ShapeDtypeStruct(q_p.shape, q.dtype),
        input_output_aliases={9: 0},
        compiler_params=_TritonParams(num_warps=warps, num_stages=num_stages),
        interpret=interpret,
        name="ragged_paged_attention_gpu",
    )(*work, seq_lens, tables, q_p, k_pages, v_pages, out_init)
    return out[:T, :, :G, :].reshape(T, H, D)
