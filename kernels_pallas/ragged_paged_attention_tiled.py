"""Tiled ragged paged attention in plain jnp: the CPU path (in production its decode rows run the
native kernel of cpu_decode_attention.py instead of jnp_decode_rows, wherever that kernel builds).

The reference (ragged_paged_attention_reference.py) gathers the KV context once per query row,
which is right for decode but repeats the same gather q_len times for a prefill chunk. Here the
sequences of a step are split by what they need:

- decode sequences (one new token): sorted by context length, longest first, and batched in
  blocks of up to 64 rows; each block runs one loop over KV chunks (an online softmax) up to its
  own longest context, gathering every row's pages of a chunk at once (the chunk sized so the
  gathered chunk of the block stays in cache). A step's decodes are the bulk of its KV reads:
  blocks keep them in a few big ops while a short sequence never waits through a long one's
  chunks, and the cache budget holds for any number of decodes.
- chunk sequences (two or more new tokens: prefill chunks): tiles of consecutive rows of one
  sequence, visited by a loop whose trip count is the number of live tiles (data, not shape);
  each tile gathers only its own sequence's pages, once per KV chunk, up to its own causal end.
  Tiles are tall (up to 256 rows: big products, few loop trips); shorter sequences get passes of
  half- and quarter-height tiles of their own, so no tile is more than half padding above 64 rows.

Attention sinks (gpt-oss, `sinks` [H]): each row's online softmax starts from the sink instead of
from nothing -- running max = sinks[h], running sum = exp(sinks[h] - sinks[h]) = 1, numerator 0 --
which is the sink as one more key with a zero value vector.

Splitting matters for mixed steps (many decodes + a long prefill chunk): one tiling for both made
every decode item as tall as a prefill tile, or every prefill tile as short as a decode row (which
re-gathered the chunk's context once per few rows). Each tile's rows are written with a select, so
rows outside a sequence (and padding rows) keep zeros and stale or NaN slots never leak.
"""
from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

from kernels_pallas._checks import CHUNK_TOKENS, MASK_VALUE, check_attention_args
from kernels_pallas.kv_quant import gather_pages

# Rows per prefill tile at most: 256 measured 1.3-1.9x faster than 64 on 2,048-token prefill steps
# of 1-4 sequences (bench-105m shapes, docs/BENCHMARKS.md optimisation log).
_MAX_BLOCK_Q = 256
_TILE_HEIGHTS = 3  # 256, 128 and 64 rows: 64-token prompts keep the 64-row tiles they had before
_TILE_CHUNK_TOKENS = 256  # KV positions per step of a prefill tile's loop
# Bytes of K gathered per step of a decode block's loop: chunks that stay in the CPU's cache
# measured 1.4-1.8x faster than 128-token chunks for 64 decodes (docs/BENCHMARKS.md).
_DECODE_CHUNK_BYTES = 2 << 20
# Decode rows per block: 64 measured fastest (vs 32 and 128) at 64-256 decodes of ragged contexts,
# and level with one unsorted batch below 64 (docs/BENCHMARKS.md, optimisation log).
_DECODE_BLOCK_ROWS = 64


def _decode_chunk_pages(rows: int, page_size: int, kv_heads: int, head_dim: int, max_pages: int) -> int:
    """Pages per step of a decode block's loop: the most (a power of two, at most CHUNK_TOKENS
    worth) whose gathered K for the block's `rows` fits _DECODE_CHUNK_BYTES (float32)."""
    per_page = rows * page_size * kv_heads * head_dim * 4
    pages = max(1, CHUNK_TOKENS // page_size)
    while pages > 1 and pages * per_page > _DECODE_CHUNK_BYTES:
        pages //= 2
    return min(pages, max_pages)


def default_block_q(num_tokens: int) -> int:
    """Rows per tall prefill tile: the largest power of two <= T, capped at 256 (decodes never use
    tiles)."""
    return min(_MAX_BLOCK_Q, 1 << (max(1, num_tokens).bit_length() - 1))


def _chunked_tables(page_tables: jax.Array, pages_per_chunk: int) -> tuple[jax.Array, int]:
    """Page tables padded to whole chunks of `pages_per_chunk` pages, and the static chunk count."""
    max_pages = page_tables.shape[-1]
    num_chunks = -(-max_pages // pages_per_chunk)
    pad = [(0, 0)] * (page_tables.ndim - 1) + [(0, num_chunks * pages_per_chunk - max_pages)]
    return jnp.pad(page_tables, pad), num_chunks


def _online_softmax_step(carry, s, v, mask, einsum_pv: str):
    """One KV chunk of the online softmax. s: scores [..., C] (already masked), mask like s."""
    m, l, acc = carry
    m_new = jnp.maximum(m, s.max(axis=-1))
    alpha = jnp.exp(m - m_new)
    p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
    l = alpha * l + p.sum(axis=-1)
    acc = alpha[..., None] * acc + jnp.einsum(einsum_pv, p, v)
    return m_new, l, acc


def _softmax_init(sinks, shape, group: int, head_dim: int):
    """(m, l, acc) before any key: shape = (*rows, KVH, G) or (KVH, rows * G) (row-major over
    (row, group), `group` heads per kv head). With sinks the sink is the first key seen."""
    acc = jnp.zeros((*shape, head_dim), jnp.float32)
    if sinks is None:
        return jnp.full(shape, MASK_VALUE, jnp.float32), jnp.zeros(shape, jnp.float32), acc
    kvh = sinks.shape[0] // group
    if len(shape) == 2:  # [KVH, rows * G]
        m = jnp.broadcast_to(sinks.reshape(kvh, 1, group), (kvh, shape[1] // group, group)).reshape(shape)
    else:  # [..., KVH, G]
        m = jnp.broadcast_to(sinks.reshape(kvh, group), shape)
    return m, jnp.ones(shape, jnp.float32), acc


def _scores(q, k, einsum_qk: str, sm_scale: float, soft_cap: float | None, mask) -> jax.Array:
    s = jnp.einsum(einsum_qk, q, k) * sm_scale
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    return jnp.where(mask, s, MASK_VALUE)


def jnp_decode_rows(q_rows, k_pages, v_pages, k_scales, v_scales, ctx, page_tables, *, sm_scale, sliding_window,
                    soft_cap, sinks=None, v_head_dim: int) -> jax.Array:
    """Attention of every decode sequence's single row (q_rows [S, H, D] float32, ctx [S]: its
    context, 0 for sequences that are not decodes), in blocks of rows sorted by context: [S, H, Dv]
    float32 (row s is sequence s's output; sequences that are not decodes get zeros). v_pages None:
    the values are the first v_head_dim lanes of K's rows."""
    S, H, D = q_rows.shape
    Dv = v_head_dim
    MP = page_tables.shape[1]
    num_pages, ps, KVH, _ = k_pages.shape
    G = H // KVH
    R = min(_DECODE_BLOCK_ROWS, S)
    num_blocks = -(-S // R)
    cp = _decode_chunk_pages(R, ps, KVH, D, MP)
    chunk = cp * ps
    tables, num_chunks_static = _chunked_tables(page_tables, cp)
    q_rows = q_rows.reshape(S, KVH, G, D)
    # Longest first, so a block's first row bounds its loop; the padding rows of the last block
    # point at row 0 with context 0 (they compute zeros and are never read back).
    order = jnp.pad(jnp.argsort(-ctx).astype(jnp.int32), (0, num_blocks * R - S))
    sorted_ctx = jnp.pad(ctx[order[:S]], (0, num_blocks * R - S))               # [num_blocks * R]

    def block(b, out):
        rows = lax.dynamic_slice_in_dim(order, b * R, R)                        # [R]
        row_ctx = lax.dynamic_slice_in_dim(sorted_ctx, b * R, R)                # [R]
        table, q = tables[rows], q_rows[rows]

        def body(c, carry):
            pages = jnp.clip(lax.dynamic_slice_in_dim(table, c * cp, cp, axis=1), 0, num_pages - 1)
            kv_pos = c * chunk + jnp.arange(chunk, dtype=jnp.int32)              # [C]
            valid = kv_pos[None, :] < row_ctx[:, None]                           # [R, C]; the row sits at ctx - 1
            if sliding_window is not None:
                valid &= (row_ctx[:, None] - 1) - kv_pos[None, :] < sliding_window
            k = gather_pages(k_pages, k_scales, pages)                           # [R, C, KVH, D] f32
            v = k[..., :Dv] if v_pages is None else gather_pages(v_pages, v_scales, pages)
            # Stale (even NaN) V outside every row's mask must not reach 0 * NaN in the sum.
            v = jnp.where(valid[:, :, None, None], v, 0.0)
            mask = valid[:, None, None, :]                                       # [R, 1, 1, C]
            s = _scores(q, k, "skgd,sckd->skgc", sm_scale, soft_cap, mask)        # [R, KVH, G, C]
            return _online_softmax_step(carry, s, v, mask, "skgc,sckd->skgd")

        init = _softmax_init(sinks, (R, KVH, G), G, Dv)
        num_chunks = jnp.minimum((row_ctx[0] + chunk - 1) // chunk, num_chunks_static)
        _, l, acc = lax.fori_loop(0, num_chunks, body, init)
        res = (acc / jnp.where(l > 0, l, 1.0)[..., None]).reshape(R, H, Dv)
        return lax.dynamic_update_slice_in_dim(out, res, b * R, 0)

    live_blocks = (jnp.sum(ctx > 0) + R - 1) // R
    by_rank = lax.fori_loop(0, live_blocks, block, jnp.zeros((num_blocks * R, H, Dv), jnp.float32))
    rank = jnp.zeros((S,), jnp.int32).at[order[:S]].set(jnp.arange(S, dtype=jnp.int32))
    return by_rank[rank]


def _chunk_tiles(q_padded, k_pages, v_pages, k_scales, v_scales, seq_lens, cu_q_lens, page_tables, q_len, is_chunk, out,
                 *, bq, sm_scale, sliding_window, soft_cap, sinks) -> jax.Array:
    """`out` with the attention of every row of the `is_chunk` sequences written in, tile by tile
    (other rows keep what they held). q_padded [T + at least bq, H, D] and out [.., H, Dv] float32 (a
    tile may run past T); v_pages None: the values are the first Dv lanes of K's rows."""
    _, H, D = q_padded.shape
    Dv = out.shape[-1]
    S, MP = page_tables.shape
    num_pages, ps, KVH, _ = k_pages.shape
    G = H // KVH
    cp = max(1, min(MP, _TILE_CHUNK_TOKENS // ps))
    chunk = cp * ps
    tables, num_chunks_static = _chunked_tables(page_tables, cp)
    tiles = jnp.where(is_chunk, (q_len + bq - 1) // bq, 0)                      # [S]
    tile_end = jnp.cumsum(tiles)

    def tile(i, out):
        s = jnp.minimum(jnp.searchsorted(tile_end, i, side="right").astype(jnp.int32), S - 1)
        first = cu_q_lens[s] + (i - (tile_end[s] - tiles[s])) * bq
        rows = first + jnp.arange(bq, dtype=jnp.int32)                           # [bq]
        row_ok = rows < cu_q_lens[s + 1]
        ctx = seq_lens[s]
        row_pos = ctx - q_len[s] + (rows - cu_q_lens[s])                         # [bq]
        # [KVH, bq * G, D]: row-major over (row, group) so a row's mask repeats over its G heads.
        qt = lax.dynamic_slice_in_dim(q_padded, first, bq).reshape(bq, KVH, G, D)
        qt = qt.transpose(1, 0, 2, 3).reshape(KVH, bq * G, D)
        table = tables[s]
        last = jnp.max(jnp.where(row_ok, row_pos, 0))
        hi = jnp.minimum(last // chunk + 1, num_chunks_static)
        lo = 0
        if sliding_window is not None:
            lo = jnp.maximum(jnp.min(jnp.where(row_ok, row_pos, last)) - sliding_window + 1, 0) // chunk

        def body(c, carry):
            pages = jnp.clip(lax.dynamic_slice_in_dim(table, c * cp, cp), 0, num_pages - 1)
            kv_pos = c * chunk + jnp.arange(chunk, dtype=jnp.int32)               # [C]
            valid = row_ok[:, None] & (kv_pos[None, :] <= row_pos[:, None])       # [bq, C]
            if sliding_window is not None:
                valid &= row_pos[:, None] - kv_pos[None, :] < sliding_window
            mask = jnp.broadcast_to(valid[:, None, :], (bq, G, chunk)).reshape(1, bq * G, chunk)
            k = gather_pages(k_pages, k_scales, pages).transpose(1, 0, 2)           # [KVH, C, D] f32
            v = k[..., :Dv] if v_pages is None else gather_pages(v_pages, v_scales, pages).transpose(1, 0, 2)
            v = jnp.where((kv_pos < ctx)[None, :, None], v, 0.0)                 # stale / NaN slots
            sc = _scores(qt, k, "kqd,kcd->kqc", sm_scale, soft_cap, mask)         # [KVH, bq*G, C]
            return _online_softmax_step(carry, sc, v, mask, "kqc,kcd->kqd")

        init = _softmax_init(sinks, (KVH, bq * G), G, Dv)
        _, l, acc = lax.fori_loop(lo, hi, body, init)
        res = (acc / jnp.where(l > 0, l, 1.0)[..., None]).reshape(KVH, bq, G, Dv).transpose(1, 0, 2, 3)
        res = res.reshape(bq, H, Dv)
        current = lax.dynamic_slice_in_dim(out, first, bq)
        return lax.dynamic_update_slice_in_dim(out, jnp.where(row_ok[:, None, None], res, current), first, 0)

    return lax.fori_loop(0, tile_end[-1], tile, out)


def tiled_backend(decode_rows: Callable[..., jax.Array], name: str, doc: str) -> Callable[..., jax.Array]:
    """A jitted attention function with every backend's signature (docs/CONTRACTS.md) that runs the
    tiled path with its decode rows' attention from `decode_rows` (jnp_decode_rows' signature):
    ragged_paged_attention_tiled, and the CPU backend with the native decode kernel."""

    def attention(
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
        k_scales: jax.Array | None = None,  # [P, KVH, ps] float32 when the pages are quantized (kv_quant.py)
        v_scales: jax.Array | None = None,
        sinks: jax.Array | None = None,  # [H] float32: one value-less logit per q head (gpt-oss)
        v_head_dim: int | None = None,
    ) -> jax.Array:  # [T, H, Dv], q.dtype
        Dv = check_attention_args(
            q, k_pages, v_pages, seq_lens, cu_q_lens, page_tables, num_seqs,
            sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
            k_scales=k_scales, v_scales=v_scales, sinks=sinks, v_head_dim=v_head_dim,
        ).v_head_dim
        T, H, D = q.shape
        S = page_tables.shape[0]
        live = jnp.arange(S, dtype=jnp.int32) < num_seqs[0]
        q_len = jnp.where(live, cu_q_lens[1:] - cu_q_lens[:-1], 0)                  # [S]
        is_decode = q_len == 1
        # Tile heights, tallest first; a sequence of q_len rows goes to the shortest height >= q_len
        # (the tallest takes every longer one), so a tile is at most half padding.
        heights = [block_q] if block_q else sorted({max(1, default_block_q(T) >> i) for i in range(_TILE_HEIGHTS)},
                                                   reverse=True)
        qf = q.astype(jnp.float32)
        kw = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap, sinks=sinks)
        q_padded = jnp.pad(qf, ((0, heights[0]), (0, 0), (0, 0)))
        out = jnp.zeros((T + heights[0], H, Dv), jnp.float32)
        for i, bq in enumerate(heights):
            lo = heights[i + 1] if i + 1 < len(heights) else 1  # shorter sequences go to the next height
            which = (q_len > lo) if i == 0 else (q_len > lo) & (q_len <= bq)
            out = _chunk_tiles(q_padded, k_pages, v_pages, k_scales, v_scales, seq_lens, cu_q_lens, page_tables, q_len,
                               which, out, bq=bq, **kw)
        out = out[:T]
        q_rows = qf[jnp.clip(cu_q_lens[:-1], 0, T - 1)]                              # [S, H, D]
        ctx = jnp.where(is_decode, seq_lens, 0)                                      # [S]
        decoded = decode_rows(q_rows, k_pages, v_pages, k_scales, v_scales, ctx, page_tables, v_head_dim=Dv, **kw)
        out = out.at[jnp.where(is_decode, cu_q_lens[:-1], T)].set(decoded, mode="drop")  # others -> dropped
        return out.astype(q.dtype)

    attention.__name__ = attention.__qualname__ = name
    attention.__doc__ = doc
    return jax.jit(attention, static_argnames=("sm_scale", "sliding_window", "soft_cap", "block_q", "v_head_dim"))


ragged_paged_attention_tiled = tiled_backend(
    jnp_decode_rows, "ragged_paged_attention_tiled",
    """Same contract and numbers as the reference (docs/CONTRACTS.md); block_q = rows of every prefill
    tile (default: 256-, 128- and 64-row tiles, each sequence in the shortest that holds it).""")
