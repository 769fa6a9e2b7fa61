"""Ragged paged attention as a GPU Pallas kernel (Triton backend).

Schedule:
  * The wrapper cuts every sequence's q rows into tiles of BQ tokens and lists them as work
    items (sequence, first row, rows in tile, position of first row). A batch has at most
    cdiv(T, BQ) + S tiles, which is the static grid size W; items past the real count are empty.
  * grid = (W, KVH). Program (w, h) loads its q tile for the G query heads of kv head h as one
    [BQ*Gp, D] matrix (rows token-major, GQA group minor; Gp = G rounded up to a power of two),
    then walks the kv blocks its rows can see (causal end, sliding-window start), gathering each
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
  * Attention sinks (gpt-oss, `sinks` [H] f32): the wrapper lays them out per tile row, [KVH, R]
    (row t * Gp + g of kv head h: sinks[h * G + g]); a program's running max starts there and its
    running sum at 1, the sink being a first key with a zero value vector.

Triton needs power-of-two block shapes and dot operands of at least 16 in each dimension:
head_dim and page_size must be powers of two and head_dim at most 256 (`supports()` says whether a
shape runs here; `kernels_pallas.ragged_paged_attention` sends the others to the reference).

Shared memory (measured on sm_90a from the per-kernel figures XLA reports for compile-only H100s,
jax 0.10.2, ~1100 configurations): the kernel keeps the q tile [R, D] and, per pipeline stage, one
K and one V block [BK, D] in shared memory, R = block_q * Gp rows; a few bytes a row go to
reductions, and float32 inputs at IEEE precision (jax's "highest"; the default is TF32 on the
tensor cores) also stage a float32 [R, BK] tile. `shared_memory_bytes` adds these up (a bound the
measurements reached within 1%), the default blocks shrink (BK first, down to 16 keys, then
block_q) until it fits `MAX_SHARED_MEMORY` (227 KiB per block on H100/H200), and explicit blocks
that do not fit raise ValueError before Triton is reached.
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
# Largest head_dim `supports()` accepts: every group size up to 128 then fits MAX_SHARED_MEMORY in
# float32 with the smallest blocks (4 * 256 * (128 + 2 * 16 * 2) + (32 + 4 * 16) * 128 = 204 KiB).
MAX_HEAD_DIM = 256
# Shared memory one thread block may use on sm_90 (H100 / H200): 227 KiB of the 228 KiB per SM
# (CUDA C++ Programming Guide, "Compute Capabilities" table; the target's
# shared_memory_per_block_optin). Smaller parts (A100: 163 KiB, sm_86/sm_89: 99 KiB) need smaller
# explicit blocks, or XLA rejects the program at compile time.
MAX_SHARED_MEMORY = 227 * 1024
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
    v_ref,  # [P, ps, KVH, D]
    *refs,  # quantized pages: k_scales, v_scales [P, KVH, ps] f32; sinks: [KVH, BQ*Gp] f32;
    # then _o_in_ref (aliased), o_ref
    quantized: bool,
    has_sinks: bool,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    block_q: int,
    block_kv: int,
):
    ks_ref, vs_ref = refs[:2] if quantized else (None, None)
    sinks_ref = refs[2 if quantized else 0] if has_sinks else None
    o_ref = refs[-1]  # [T + BQ, KVH, Gp, D]
    _, _, group_p, head_dim = q_ref.shape
    num_pages, page_size, _, _ = k_ref.shape
    rows = block_q * group_p
    # A block is NPB whole pages (BK >= ps) or a BK-key slice of one page (BK < ps).
    pages_per_block = max(1, block_kv // page_size)
    keys_per_page = min(block_kv, page_size)
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
            first_key = kb * block_kv
            first_page = first_key // page_size
            page_idx = first_page + jnp.arange(pages_per_block, dtype=jnp.int32)
            pages = tables_ref[s, pl.ds(first_page, pages_per_block)]  # [NPB]
            # Entries past the sequence's pages are never read; clip so no id becomes a wild pointer.
            pages = jnp.clip(jnp.where(page_idx < num_seq_pages, pages, 0), 0, num_pages - 1)
            # Pointer gather [NPB, keys per page, D]: every axis indexed by a broadcast array, which
            # both the Triton lowering and the interpreter accept. The block's first slot is
            # first_key mod ps: nonzero only when the block is a slice of a page (written as a
            # subtraction: the Triton lowering rejects jnp's floor-mod of int32 scalars).
            shape3 = (pages_per_block, keys_per_page, head_dim)
            first_slot = first_key - first_page * page_size
            slot = first_slot + lax.broadcasted_iota(jnp.int32, shape3, 1)
            dim = lax.broadcasted_iota(jnp.int32, shape3, 2)
            page3 = jnp.broadcast_to(pages[:, None, None], shape3)
            kv_real = (page_idx[:, None, None] * page_size + slot) < seq_len
            if quantized:
                # 8-bit pages widen exactly to q's dtype; Triton has no int -> float8 cast for a
                # masked load's fill value, so stale slots are zeroed after widening.
                k = jnp.where(kv_real, plgpu.load(k_ref.at[page3, slot, h, dim]).astype(q.dtype), 0.0)
                v = jnp.where(kv_real, plgpu.load(v_ref.at[page3, slot, h, dim]).astype(q.dtype), 0.0)
            else:  # stale slots (even NaN) load as 0
                k = plgpu.load(k_ref.at[page3, slot, h, dim], mask=kv_real, other=0.0)
                v = plgpu.load(v_ref.at[page3, slot, h, dim], mask=kv_real, other=0.0)
            k = k.reshape(block_kv, head_dim)
            v = v.reshape(block_kv, head_dim)

            logits = lax.dot_general(
                q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
            ) * sm_scale  # [rows, BK]
            if quantized:
                # Per-key scales [1, BK] (kv_quant.py): on the logits here, on p before the PV dot.
                # Built from iotas, not sliced from the 3-D indices: Triton has no tensor slicing.
                shape2 = (pages_per_block, keys_per_page)
                slot2 = first_slot + lax.broadcasted_iota(jnp.int32, shape2, 1)
                page2 = jnp.broadcast_to(pages[:, None], shape2)
                real2 = (page_idx[:, None] * page_size + slot2) < seq_len
                k_scale = plgpu.load(ks_ref.at[page2, h, slot2], mask=real2, other=0.0).reshape(1, block_kv)
                v_scale = plgpu.load(vs_ref.at[page2, h, slot2], mask=real2, other=0.0).reshape(1, block_kv)
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
            pv = lax.dot_general(
                (p * v_scale if quantized else p).astype(v.dtype), v, (((1,), (0,)), ((), ())),
                preferred_element_type=jnp.float32,
            )  # [rows, D]
            return m_new, l_new, alpha[:, None] * acc + pv

        if has_sinks:  # the sink as a first key with a zero value: max = sink, sum = exp(0) = 1
            m0, l0 = sinks_ref[h, :], jnp.ones((rows,), jnp.float32)
        else:
            m0, l0 = jnp.full((rows,), MASK_VALUE, jnp.float32), jnp.zeros((rows,), jnp.float32)
        init = (m0, l0, jnp.zeros((rows, head_dim), jnp.float32))
        _, l, acc = lax.fori_loop(kb_start, kb_end, body, init)
        out = acc / jnp.where(l > 0, l, 1.0)[:, None]
        out = out.reshape(block_q, group_p, head_dim).astype(o_ref.dtype)
        live = (
            lax.broadcasted_iota(jnp.int32, (block_q, group_p, head_dim), 0) < n_rows
        )
        plgpu.store(o_ref.at[pl.ds(row0, block_q), h, :, :], out, mask=live)


def supports(*, head_dim: int, page_size: int) -> bool:
    """Whether this kernel handles these sizes: power-of-two head_dim in [16, MAX_HEAD_DIM] (Triton
    block shapes are powers of two, dots need 16) and a power-of-two page_size (any size: pages
    larger than a kv block are read a slice at a time)."""
    return (is_power_of_two(head_dim) and _MIN_DOT <= head_dim <= MAX_HEAD_DIM
            and is_power_of_two(page_size))


def shared_memory_bytes(
    *, block_q: int, group_p: int, block_kv: int, head_dim: int, itemsize: int, num_stages: int
) -> int:
    """Upper bound on the shared memory one program uses: the q tile [block_q * Gp, D] plus one
    K and one V block [BK, D] per pipeline stage, 32 bytes a q row for the row reductions and
    pipeline barriers, and for 4-byte inputs a float32 [rows, BK] tile (the IEEE float32 dots
    stage the probabilities through shared memory). See the module docstring for the measurements."""
    rows = block_q * group_p
    tiles = itemsize * head_dim * (rows + 2 * block_kv * max(1, num_stages))
    return tiles + 32 * rows + (4 * rows * block_kv if itemsize >= 4 else 0)


def default_block_q(num_tokens: int, max_seqs: int, group_p: int) -> int:
    """Decode-heavy buckets (T <= 2S) get 16-row tiles, prefill buckets 64-row tiles."""
    target_rows = _MIN_DOT if num_tokens <= 2 * max_seqs else 64
    return max(1, target_rows // group_p)


def default_block_kv(page_size: int) -> int:
    """64 keys per kv block, or one whole page when pages are larger."""
    return max(64, page_size)


def choose_blocks(
    *,
    num_tokens: int,
    max_seqs: int,
    group_p: int,
    head_dim: int,
    page_size: int,
    itemsize: int,
    num_stages: int,
    block_q: int | None = None,
    block_kv: int | None = None,
    max_shared_memory: int | None = None,
) -> tuple[int, int]:
    """(block_q, block_kv): the given ones as they are; defaults for the others, halved (the kv
    block first, down to 16 keys, then the q tile, down to 16 rows) until
    `shared_memory_bytes` fits `max_shared_memory` (default MAX_SHARED_MEMORY). The result may still
    not fit (explicit blocks, or no default small enough): the caller checks."""
    limit = MAX_SHARED_MEMORY if max_shared_memory is None else max_shared_memory
    bq = block_q or default_block_q(num_tokens, max_seqs, group_p)
    bk = block_kv or default_block_kv(page_size)

    def fits(bq: int, bk: int) -> bool:
        return shared_memory_bytes(block_q=bq, group_p=group_p, block_kv=bk, head_dim=head_dim,
                                   itemsize=itemsize, num_stages=num_stages) <= limit

    while not fits(bq, bk):
        if block_kv is None and bk > _MIN_DOT:
            bk //= 2
        elif block_q is None and bq > 1 and bq * group_p > _MIN_DOT:
            bq //= 2
        else:
            break
    return bq, bk


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
    block_kv: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 2,
    interpret: bool = False,
    k_scales: jax.Array | None = None,  # [P, KVH, ps] float32 for quantized pages (kv_quant.py)
    v_scales: jax.Array | None = None,
    sinks: jax.Array | None = None,  # [H] float32: one value-less logit per q head (gpt-oss)
) -> jax.Array:  # [T, H, D]
    """Ragged paged attention on GPU (see docs/CONTRACTS.md); `interpret` runs on any backend.

    Tuning knobs (static, powers of two; None picks a default that fits shared memory):
    `block_q` token rows per q tile, `block_kv` keys per kv block (whole pages when it is at least
    the page size, else a slice of one page), Triton's `num_warps` and `num_stages`.
    """
    dims = check_attention_args(
        q, k_pages, v_pages, seq_lens, cu_q_lens, page_tables, num_seqs,
        sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
        k_scales=k_scales, v_scales=v_scales, sinks=sinks,
    )
    for name, value in (("block_q", block_q), ("block_kv", block_kv), ("num_warps", num_warps),
                        ("num_stages", num_stages)):
        check_block_arg(name, value)
    if not supports(head_dim=dims.head_dim, page_size=dims.page_size):
        raise ValueError(
            f"GPU kernel needs a power-of-two head_dim in [{_MIN_DOT}, {MAX_HEAD_DIM}] and a "
            f"power-of-two page_size; got head_dim={dims.head_dim}, page_size={dims.page_size}"
        )
    T, H, D = q.shape
    KVH, G, S, MP = dims.num_kv_heads, dims.group, dims.max_seqs, dims.max_pages_per_seq
    ps = dims.page_size
    gp = next_power_of_two(G)
    for name, value in (("block_q", block_q), ("block_kv", block_kv)):
        if value is not None and not is_power_of_two(value):
            raise ValueError(f"{name} must be a power of two, got {value}")
    itemsize = jnp.dtype(q.dtype).itemsize
    bq, bk = choose_blocks(
        num_tokens=T, max_seqs=S, group_p=gp, head_dim=D, page_size=ps, itemsize=itemsize,
        num_stages=num_stages, block_q=block_q,
        block_kv=block_kv,
    )
    npb = max(1, bk // ps)
    if not interpret:
        if bq * gp < _MIN_DOT or bk < _MIN_DOT:
            raise ValueError(
                f"block_q * group ({bq * gp}) and block_kv ({bk} keys) must be >= {_MIN_DOT} "
                f"for Triton dots"
            )
        smem = shared_memory_bytes(block_q=bq, group_p=gp, block_kv=bk, head_dim=D,
                                   itemsize=itemsize, num_stages=num_stages)
        if smem > MAX_SHARED_MEMORY:
            layout = (f"{bk // ps} pages of {ps} keys" if bk >= ps
                      else f"a 1/{ps // bk} slice of a {ps}-key page")
            raise ValueError(
                f"GPU kernel blocks need ~{smem} bytes of shared memory, more than the "
                f"{MAX_SHARED_MEMORY} one block may use (sm_90): block_q={bq}, block_kv={bk} "
                f"({layout}), num_stages={num_stages}, with group={G} (padded to {gp}), "
                f"head_dim={D}, dtype={jnp.dtype(q.dtype).name}; use a smaller block_q, "
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
    out_init = jnp.zeros_like(q_p)

    kernel = functools.partial(
        _kernel, sm_scale=float(sm_scale), sliding_window=sliding_window, soft_cap=soft_cap,
        block_q=bq, block_kv=bk, quantized=k_scales is not None, has_sinks=sinks is not None,
    )
    warps = num_warps or (4 if bq * gp <= 64 else 8)
    scales = () if k_scales is None else (k_scales, v_scales)
    # sinks per tile row [KVH, BQ * Gp]; padded heads get 0 (their rows are never stored)
    sink_rows = () if sinks is None else (jnp.broadcast_to(
        jnp.pad(sinks.reshape(KVH, 1, G), ((0, 0), (0, 0), (0, gp - G))), (KVH, bq, gp)).reshape(KVH, bq * gp),)
    operands = (*work, seq_lens, tables, q_p, k_pages, v_pages, *scales, *sink_rows, out_init)
    out = pl.pallas_call(
        kernel,
        grid=(num_items, KVH),
        out_shape=jax.ShapeDtypeStruct(q_p.shape, q.dtype),
        input_output_aliases={len(operands) - 1: 0},
        compiler_params=_TritonParams(num_warps=warps, num_stages=num_stages),
        interpret=interpret,
        name="ragged_paged_attention_gpu",
    )(*operands)
    return out[:T, :, :G, :].reshape(T, H, D)
