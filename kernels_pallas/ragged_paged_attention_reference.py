"""Pure-jnp ragged paged attention: the numerical reference and the CPU production path.

Every query row is mapped to its sequence (`row_seq`, from `cu_q_lens` by searchsorted); the KV
context is then walked in chunks of `chunk_pages` pages with an online (flash-style) softmax,
gathering for each row only the pages of its own sequence.

Memory: one chunk holds K and V gathered per row, `2 * T * chunk_pages * page_size * KVH * D`
float32 values, plus the `[T, H, chunk]` logits. `chunk_pages` is chosen statically so that one
gathered K chunk stays under `_CHUNK_BYTES` (32 MiB) unless a single page is already larger; peak
use is a few times that (K and V, their float32 casts); the running state is `[T, H, D]` float32.
Compute is `T * ceil(max_len / chunk) * chunk * H * D` multiply-adds: every row walks the chunks
up to the longest live sequence (the loop trip count is dynamic, so short batches stop early).

Attention sinks (gpt-oss): `sinks[h]` is one more logit in every row of head h with no value
vector. The online softmax ends with (m, l, acc) = (max logit, sum of exp(s - m), sum of
exp(s - m) v); the sink is folded in after the loop, written out as the formula:
out = acc * exp(m - m') / (l * exp(m - m') + exp(sink - m')) with m' = max(m, sink).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from kernels_pallas._checks import CHUNK_TOKENS, MASK_VALUE, check_attention_args
from kernels_pallas.kv_quant import gather_pages

_CHUNK_BYTES = 32 * 1024 * 1024


def row_to_seq(
    cu_q_lens: jax.Array,  # [S + 1] int32
    num_seqs: jax.Array,  # [1] int32
    rows: jax.Array,  # [R] int32 token row indices
) -> tuple[jax.Array, jax.Array]:
    """Returns (seq index [R] clipped to [0, S-1], row is a live row [R] bool).

    Sequences past `num_seqs` get an end of int32 max, so whatever `cu_q_lens` holds there,
    no row maps into them; rows at or past `cu_q_lens[num_seqs]` are not live.
    """
    max_seqs = cu_q_lens.shape[0] - 1
    seq_ids = jnp.arange(max_seqs, dtype=jnp.int32)
    ends = jnp.where(seq_ids < num_seqs[0], cu_q_lens[1:], jnp.iinfo(jnp.int32).max)
    seq = jnp.searchsorted(ends, rows, side="right").astype(jnp.int32)
    live = (seq < num_seqs[0]) & (rows >= 0)
    return jnp.minimum(seq, max_seqs - 1), live


def _default_chunk_pages(num_tokens: int, page_size: int, num_kv_heads: int, head_dim: int,
                         max_pages: int) -> int:
    # The byte cap bounds big prefills (this path gathers the context once per query row).
    per_page = num_tokens * page_size * num_kv_heads * head_dim * 4
    by_bytes = _CHUNK_BYTES // max(per_page, 1)
    by_tokens = max(1, CHUNK_TOKENS // page_size)
    return max(1, min(max_pages, by_bytes, by_tokens))


@functools.partial(
    jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap", "chunk_pages", "v_head_dim")
)
def ragged_paged_attention_reference(
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
    chunk_pages: int | None = None,
    k_scales: jax.Array | None = None,  # [P, KVH, ps] float32 when the pages are quantized (kv_quant.py)
    v_scales: jax.Array | None = None,
    sinks: jax.Array | None = None,  # [H] float32: one value-less logit per q head (gpt-oss)
    v_head_dim: int | None = None,
) -> jax.Array:  # [T, H, Dv], q.dtype
    """Ragged paged attention in plain jnp, float32 softmax. See docs/CONTRACTS.md."""
    dims = check_attention_args(
        q, k_pages, v_pages, seq_lens, cu_q_lens, page_tables, num_seqs,
        sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
        k_scales=k_scales, v_scales=v_scales, sinks=sinks, v_head_dim=v_head_dim,
    )
    Dv = dims.v_head_dim
    if chunk_pages is not None and (not isinstance(chunk_pages, int) or chunk_pages < 1):
        raise ValueError(f"chunk_pages must be None or a positive int, got {chunk_pages!r}")
    T, H, D = q.shape
    ps, KVH, G, MP = dims.page_size, dims.num_kv_heads, dims.group, dims.max_pages_per_seq
    cp = chunk_pages or _default_chunk_pages(T, ps, KVH, D, MP)
    cp = min(cp, MP)
    chunk = cp * ps
    num_chunks_static = -(-MP // cp)
    # Pad the table so every chunk slice is in bounds; padded entries are masked.
    tables = jnp.pad(page_tables, ((0, 0), (0, num_chunks_static * cp - MP)))

    rows = jnp.arange(T, dtype=jnp.int32)
    row_seq, live = row_to_seq(cu_q_lens, num_seqs, rows)  # [T], [T]
    q_len = cu_q_lens[row_seq + 1] - cu_q_lens[row_seq]
    row_len = jnp.where(live, seq_lens[row_seq], 0)  # [T] context length after this step
    row_pos = row_len - q_len + (rows - cu_q_lens[row_seq])  # [T] absolute position
    row_tables = tables[row_seq]  # [T, num_chunks * cp]

    qf = q.astype(jnp.float32).reshape(T, KVH, G, D)
    hi = lax.Precision.HIGHEST

    def body(c, carry):
        m, l, acc = carry  # [T, KVH, G], [T, KVH, G], [T, KVH, G, D]
        pages = lax.dynamic_slice_in_dim(row_tables, c * cp, cp, axis=1)  # [T, cp]
        pages = jnp.clip(pages, 0, dims.num_pages - 1)
        kv_pos = c * chunk + jnp.arange(chunk, dtype=jnp.int32)  # [C]
        mask = live[:, None] & (kv_pos[None, :] <= row_pos[:, None])  # [T, C]
        if sliding_window is not None:
            mask &= row_pos[:, None] - kv_pos[None, :] < sliding_window
        # Stale (even NaN) K only reaches masked scores, which `where` replaces; V is zeroed
        # outside the mask because 0 * NaN would leak into the weighted sum.
        k = gather_pages(k_pages, k_scales, pages)  # [T, chunk, KVH, D] float32
        v = k[..., :Dv] if v_pages is None else gather_pages(v_pages, v_scales, pages)
        v = jnp.where(mask[:, :, None, None], v, 0.0)
        s = jnp.einsum("tkgd,tckd->tkgc", qf, k, precision=hi) * sm_scale  # [T, KVH, G, C]
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        mask4 = mask[:, None, None, :]
        s = jnp.where(mask4, s, MASK_VALUE)
        m_new = jnp.maximum(m, s.max(axis=-1))
        alpha = jnp.exp(m - m_new)
        p = jnp.where(mask4, jnp.exp(s - m_new[..., None]), 0.0)
        l = alpha * l + p.sum(axis=-1)
        acc = alpha[..., None] * acc + jnp.einsum("tkgc,tckd->tkgd", p, v, precision=hi)
        return m_new, l, acc

    max_len = jnp.max(row_len)
    num_chunks = jnp.minimum((max_len + chunk - 1) // chunk, num_chunks_static)
    init = (
        jnp.full((T, KVH, G), MASK_VALUE, jnp.float32),
        jnp.zeros((T, KVH, G), jnp.float32),
        jnp.zeros((T, KVH, G, Dv), jnp.float32),
    )
    m, l, acc = lax.fori_loop(0, num_chunks, body, init)
    if sinks is not None:
        sink = sinks.reshape(1, KVH, G)  # q head h = kv head * G + g
        m_all = jnp.maximum(m, sink)
        keep = jnp.exp(m - m_all)
        l = l * keep + jnp.exp(sink - m_all)  # padding rows (l == 0, m = MASK_VALUE): l = 1, acc = 0
        acc = acc * keep[..., None]
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]  # padding rows: l == 0 -> output 0
    return out.reshape(T, H, Dv).astype(q.dtype)
