"""Tiled ragged paged attention in plain jnp: the CPU production path.

The reference (ragged_paged_attention_reference.py) gathers the KV context once per query row,
which is right for decode but repeats the same gather q_len times for a prefill chunk. Here the
query rows are cut into *work items*: tiles of up to `block_q` consecutive rows of one sequence
(the same tiling the GPU kernel uses). Each work item gathers its sequence's pages once per KV
chunk and computes a [block_q * G, chunk] score block per KV head, with an online softmax over
chunks. `block_q` is chosen statically from the bucket: 1 for decode-only shapes (T == S), up to
64 when a step holds long prefill chunks.

Static sizes: W = min(T, T // block_q + S) work items (each sequence adds at most one partial
tile); one chunk gathers `2 * W * chunk * KVH * D` float32 values.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from kernels_pallas._checks import CHUNK_TOKENS, MASK_VALUE, check_attention_args

_MAX_BLOCK_Q = 64


def default_block_q(num_tokens: int, max_seqs: int) -> int:
    """Rows per work item: the largest power of two <= T / S (capped), so decode gets 1."""
    per_seq = max(1, num_tokens // max(max_seqs, 1))
    return min(_MAX_BLOCK_Q, 1 << (per_seq.bit_length() - 1))


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap", "block_q"))
def ragged_paged_attention_tiled(
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
) -> jax.Array:  # [T, H, D], q.dtype
    """Same contract and numbers as the reference (docs/CONTRACTS.md), tiled by sequence."""
    dims = check_attention_args(
        q, k_pages, v_pages, seq_lens, cu_q_lens, page_tables, num_seqs,
        sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
    )
    T, H, D = q.shape
    S, MP = page_tables.shape
    ps, KVH, G = dims.page_size, dims.num_kv_heads, dims.group
    bq = block_q or default_block_q(T, S)
    W = min(T, T // bq + S)
    cp = max(1, min(MP, CHUNK_TOKENS // ps))
    chunk = cp * ps
    num_chunks_static = -(-MP // cp)
    tables = jnp.pad(page_tables, ((0, 0), (0, num_chunks_static * cp - MP)))

    # Work items: tile i of sequence s covers rows cu[s] + i*bq ... (clipped to the sequence).
    live_seq = jnp.arange(S, dtype=jnp.int32) < num_seqs[0]
    q_len = jnp.where(live_seq, cu_q_lens[1:] - cu_q_lens[:-1], 0)              # [S]
    tiles = (q_len + bq - 1) // bq
    tile_end = jnp.cumsum(tiles)                                                # [S]
    w = jnp.arange(W, dtype=jnp.int32)
    w_seq = jnp.minimum(jnp.searchsorted(tile_end, w, side="right").astype(jnp.int32), S - 1)
    w_live = w < tile_end[-1]
    first = cu_q_lens[w_seq] + (w - (tile_end[w_seq] - tiles[w_seq])) * bq      # [W]
    rows = first[:, None] + jnp.arange(bq, dtype=jnp.int32)[None, :]            # [W, bq]
    row_ok = w_live[:, None] & (rows < cu_q_lens[w_seq + 1][:, None])
    ctx = jnp.where(w_live, seq_lens[w_seq], 0)                                  # [W]
    row_pos = ctx[:, None] - q_len[w_seq][:, None] + (rows - cu_q_lens[w_seq][:, None])
    w_tables = tables[w_seq]                                                     # [W, chunks * cp]

    qb = q[jnp.clip(rows, 0, T - 1)].astype(jnp.float32).reshape(W, bq, KVH, G, D)

    def body(c, carry):
        m, l, acc = carry  # [W, KVH, G, bq] x2, [W, KVH, G, bq, D]
        pages = jnp.clip(lax.dynamic_slice_in_dim(w_tables, c * cp, cp, axis=1), 0, dims.num_pages - 1)
        kv_pos = c * chunk + jnp.arange(chunk, dtype=jnp.int32)                  # [C]
        mask = row_ok[:, :, None] & (kv_pos[None, None, :] <= row_pos[:, :, None])  # [W, bq, C]
        if sliding_window is not None:
            mask &= row_pos[:, :, None] - kv_pos[None, None, :] < sliding_window
        k = k_pages[pages].reshape(W, chunk, KVH, D).astype(jnp.float32)
        v = v_pages[pages].reshape(W, chunk, KVH, D).astype(jnp.float32)
        # Stale (even NaN) V outside every row's mask must not reach 0 * NaN in the sum.
        v = jnp.where((kv_pos[None, :] < ctx[:, None])[:, :, None, None], v, 0.0)
        s = jnp.einsum("wqkgd,wckd->wkgqc", qb, k) * sm_scale                  # [W, KVH, G, bq, C]
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        mask5 = mask[:, None, None, :, :]
        s = jnp.where(mask5, s, MASK_VALUE)
        m_new = jnp.maximum(m, s.max(axis=-1))
        alpha = jnp.exp(m - m_new)
        p = jnp.where(mask5, jnp.exp(s - m_new[..., None]), 0.0)
        l = alpha * l + p.sum(axis=-1)
        acc = alpha[..., None] * acc + jnp.einsum("wkgqc,wckd->wkgqd", p, v)
        return m_new, l, acc

    num_chunks = jnp.minimum((jnp.max(ctx) + chunk - 1) // chunk, num_chunks_static)
    init = (
        jnp.full((W, KVH, G, bq), MASK_VALUE, jnp.float32),
        jnp.zeros((W, KVH, G, bq), jnp.float32),
        jnp.zeros((W, KVH, G, bq, D), jnp.float32),
    )
    _, l, acc = lax.fori_loop(0, num_chunks, body, init)
    blocks = acc / jnp.where(l > 0, l, 1.0)[..., None]                          # [W, KVH, G, bq, D]
    blocks = blocks.transpose(0, 3, 1, 2, 4).reshape(W * bq, H, D)
    target = jnp.where(row_ok, rows, T).reshape(-1)                             # padding -> dropped
    out = jnp.zeros((T, H, D), jnp.float32).at[target].set(blocks, mode="drop")
    return out.astype(q.dtype)
