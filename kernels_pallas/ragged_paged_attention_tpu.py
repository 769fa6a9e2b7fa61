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

Block sizes and memory (see the "VMEM / SMEM budgets" section below):
  * the wrapper reads the TPU generation it is traced for (`tpu_target`: the device kind of the
    arguments' sharding mesh, else `pltpu.get_tpu_info()`), requests that generation's scoped VMEM
    budget from Mosaic (`vmem_limit_bytes`: 64 MiB on v5e/v6e, 32 MiB on v5p, 16 MiB when the
    target is unknown) and picks `block_q` / `pages_per_block` so that `vmem_bytes(...)`, an
    upper bound of what the compiled kernel holds in VMEM, fits it: defaults of ~128 q rows x
    ~128 keys, block_q halved first, then pages_per_block. Sizes that cannot fit (explicit ones,
    or shapes where even the smallest blocks are too big) raise ValueError naming the parameters;
    so do page tables too large for SMEM (max_seqs x max_pages_per_seq above ~245k entries).
  * a single 16-bit (or 8-bit) kv head is passed as [P, ps, D] (`squeeze_kv_heads`): XLA's default
    layout of [P, ps, 1, D] would otherwise cost a relayout copy of the whole cache per call.
  * 8-bit pages (int8 / float8, kernels_pallas/kv_quant.py) come with per-token scales
    [P, KVH, ps] f32, DMA'd page by page next to the values into [2, NPB, KVH, ps] buffers. The
    block's values are widened to q's dtype (exact), and per head the K scales multiply the
    logits and the V scales the probabilities, as a [1, BK] lane row (`scale_row`).
  * values read from the keys' rows (`v_pages=None`, multi-head latent attention's latent row): one
    page stream and one buffer; the values are the K block's first Dv lanes (512 of a latent row
    stored in 640), 8-bit pages' one scale row serves both, and the output is [T, H, Dv].
  * attention sinks (gpt-oss, `sinks` [H] f32) come in SMEM; each q block's running max starts at
    its rows' sinks (row r = token * G + g of kv head h reads sinks[h * G + g]) and its running
    sum at 1: the sink is a first key whose value vector is zero.

Compiled by libtpu 0.0.42.1 (compile-only topologies, no TPU attached) for v5e, v6e and v5p at
serving shapes -- head_dim 64/128/256, 1-16 kv heads, GQA groups 1-8, pages of 16-128 tokens,
sliding window, soft cap, f32 and bf16, step buckets of 16-8192 tokens, 4-256 rows, 8k-32k
contexts: tests/kernels/test_rpa_tpu_compile.py. Numerics are checked through the TPU interpreter
(tests/kernels/test_rpa_tpu.py); it has not run on TPU hardware yet. Known cost: with head_dim 64,
XLA's default layout of the [P, ps, KVH, 64] cache puts the page axis minor, so every call
relayouts (copies) the cache into the kernel's row-major operand; avoiding that needs the cache
allocated in a row-major layout (or a lane-dense cache shape), outside this kernel.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas._checks import MASK_VALUE, check_attention_args, check_block_arg, is_power_of_two
from kernels_pallas.kv_quant import is_quantized
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
    k_hbm,  # [P, ps, KVH, D] HBM ([P, ps, D] for one 16- or 8-bit head: squeeze_kv_heads)
    *refs,
    # separate values only (not `shared`): v_hbm like k_hbm
    # quantized pages only: ks_hbm (and vs_hbm unless shared) [P, KVH, ps] f32 HBM scales (kv_quant.py)
    # sinks only: sinks_ref [H] f32 SMEM
    # output
    #   o_ref [KVH, BQ*G, Dv] VMEM block
    # scratch
    #   k_buf (and v_buf unless shared) [2, NPB, ps, KVH, D] ([2, NPB, ps, D] when squeezed)
    #   quantized pages only: ks_buf (and vs_buf unless shared) [2, NPB, KVH, ps] f32
    #   sems: DMA semaphores [one per buffer above, 2 (slot)]
    #   m_ref, l_ref [KVH, BQ*G, 128] f32 running max / denominator, lane-replicated
    #   acc_ref [KVH, BQ*G, Dv] f32 running numerator
    shared: bool,
    quantized: bool,
    has_sinks: bool,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    block_q: int,
    group: int,
    max_pages: int,
):
    # With `shared` values (multi-head latent attention) every key row is also its value, its first
    # Dv lanes: one DMA per page instead of two, and V's buffers and scales are K's.
    refs = list(refs)
    v_hbm = k_hbm if shared else refs.pop(0)
    ks_hbm, vs_hbm = (None, None)
    if quantized:
        ks_hbm = refs.pop(0)
        vs_hbm = ks_hbm if shared else refs.pop(0)
    sinks_ref = refs.pop(0) if has_sinks else None
    o_ref, k_buf = refs.pop(0), refs.pop(0)
    v_buf = k_buf if shared else refs.pop(0)
    ks_buf, vs_buf = (None, None)
    if quantized:
        ks_buf = refs.pop(0)
        vs_buf = ks_buf if shared else refs.pop(0)
    sems, m_ref, l_ref, acc_ref = refs
    num_kv_heads, rows, v_dim = acc_ref.shape
    head_dim = k_buf.shape[-1]
    _, pages_per_block, page_size = k_buf.shape[:3]
    squeezed = k_buf.ndim == 4  # a single kv head, passed without its unit axis (squeeze_kv_heads)
    num_pages = k_hbm.shape[0]
    block_kv = pages_per_block * page_size
    max_seqs = seq_lens_ref.shape[0]
    b = pl.program_id(0)
    row0 = b * block_q  # first token row of this q block
    row_end = row0 + block_q
    num_seqs = num_seqs_ref[0]

    if has_sinks:  # the sink as a first key with a zero value: max = sink, sum = exp(0) = 1
        r = lax.broadcasted_iota(jnp.int32, (rows, _LANES), 0)
        g_of_row = r - lax.div(r, group) * group
        for h in range(num_kv_heads):
            sink = jnp.full((rows, _LANES), sinks_ref[h * group], jnp.float32)
            for g in range(1, group):
                sink = jnp.where(g_of_row == g, sinks_ref[h * group + g], sink)
            m_ref[h] = sink
        l_ref[...] = jnp.ones(l_ref.shape, jnp.float32)
    else:
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
        """(is a real page, its copies: K, V (+ K scales, V scales)) for each page of kv block kb
        of sequence s."""
        num_seq_pages = lax.div(seq_lens_ref[s] + page_size - 1, page_size)
        copies = []
        for i in range(pages_per_block):
            j = kb * pages_per_block + i
            entry = tables_ref[s * max_pages + jnp.minimum(j, max_pages - 1)]
            page = jnp.clip(entry, 0, num_pages - 1)  # a bad id must not become a bad DMA
            pairs = [(k_hbm, k_buf)] + ([] if shared else [(v_hbm, v_buf)])
            if quantized:
                pairs += [(ks_hbm, ks_buf)] + ([] if shared else [(vs_hbm, vs_buf)])
            copies.append((j < num_seq_pages, [
                pltpu.make_async_copy(src.at[page], dst.at[slot, i], sems.at[n, slot])
                for n, (src, dst) in enumerate(pairs)]))
        return copies

    def start_fetch(s, kb, slot):
        for real, page in page_copies(s, kb, slot):
            @pl.when(real)
            def _():
                for copy in page:
                    copy.start()

    def wait_fetch(s, kb, slot):
        for real, page in page_copies(s, kb, slot):
            @pl.when(real)
            def _():
                for copy in page:
                    copy.wait()

    def scale_row(buf, slot, h, seq_len, kb):
        """One head's scales of the kv block as a lane row [1, BK] (slot t of page i at lane
        i * ps + t), zero where no live token is (unfetched buffers may hold NaN). Built with a
        one-hot matmul rather than a reshape: [NPB, ps] -> [1, NPB * ps] moves values from
        sublanes to lanes, which Mosaic lowers only for lane-aligned pieces."""
        sc = buf[slot, :, h, :]  # [NPB, ps]
        pos = kb * block_kv + lax.broadcasted_iota(jnp.int32, sc.shape, 0) * page_size + \
            lax.broadcasted_iota(jnp.int32, sc.shape, 1)
        sc = jnp.where(pos < seq_len, sc, 0.0)
        if pages_per_block == 1:
            return sc
        lane = lax.broadcasted_iota(jnp.int32, (page_size, block_kv), 1)
        spread = (lane - lax.div(lane, page_size) * page_size
                  == lax.broadcasted_iota(jnp.int32, (page_size, block_kv), 0)).astype(jnp.float32)
        tiled = lax.dot_general(sc, spread, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32,
                                precision=lax.Precision.HIGHEST)  # [NPB, BK]: page i's row repeated
        page_of_lane = lax.div(lax.broadcasted_iota(jnp.int32, tiled.shape, 1), page_size)
        mine = page_of_lane == lax.broadcasted_iota(jnp.int32, tiled.shape, 0)
        return jnp.sum(jnp.where(mine, tiled, 0.0), axis=0, keepdims=True)

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
        # Mosaic's matmul takes fp32 contract precision for f32 operands only; bf16 operands
        # accumulate in f32 through preferred_element_type at the MXU's native precision.
        # 8-bit pages are widened to q's dtype (exact) and computed like it.
        compute_dtype = q_ref.dtype
        precision = lax.Precision.HIGHEST if compute_dtype == jnp.float32 else lax.Precision.DEFAULT
        if quantized:
            # 8-bit pages widen whole (a head's rows are every KVH-th row of the packed 8-bit tiles;
            # slicing them before widening fails Mosaic's layout pass on v6e for int8 -> bf16).
            k_wide = k_buf[slot].astype(jnp.float32)  # [NPB, ps, KVH, D]
            v_wide = k_wide if shared else v_buf[slot].astype(jnp.float32)
        for h in range(num_kv_heads):
            # Unfetched / stale slots may hold anything (NaN included): zero them.
            def head_rows(buf, wide):  # kv head h of the block: [BK, D]
                if quantized:
                    head = (slice(None),) * 2 + (() if squeezed else (h,))
                    return wide[head].reshape(block_kv, head_dim).astype(compute_dtype)
                return (buf[slot] if squeezed else buf[slot, :, :, h, :]).reshape(block_kv, head_dim)

            k = head_rows(k_buf, k_wide if quantized else None)
            k = jnp.where(kv_real, k, jnp.zeros_like(k))
            if shared:  # the key rows' first Dv lanes (a lane-tile-aligned slice for MLA's 512)
                v = k[:, :v_dim]
            else:
                v = head_rows(v_buf, v_wide if quantized else None)
                v = jnp.where(kv_real, v, jnp.zeros_like(v))
            logits = lax.dot_general(
                q_ref[h], k, (((1,), (1,)), ((), ())),
                preferred_element_type=jnp.float32, precision=precision,
            ) * sm_scale  # [rows, BK]
            if quantized:  # per-key scales on the logits, and on p below (kv_quant.py)
                logits = logits * scale_row(ks_buf, slot, h, seq_len, kb)
            if soft_cap is not None:
                logits = soft_cap * jnp.tanh(logits / soft_cap)
            logits = jnp.where(mask, logits, MASK_VALUE)
            m_prev = m_ref[h, :, 0:1]  # [rows, 1]
            m_new = jnp.maximum(m_prev, logits.max(axis=1, keepdims=True))
            p = jnp.where(mask, jnp.exp(logits - m_new), 0.0)
            alpha = jnp.exp(m_prev - m_new)
            l_new = alpha * l_ref[h, :, 0:1] + p.sum(axis=1, keepdims=True)
            if quantized:
                p = p * scale_row(vs_buf, slot, h, seq_len, kb)
            pv = lax.dot_general(
                p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                preferred_element_type=jnp.float32, precision=precision,
            )  # [rows, Dv]
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


# --- VMEM / SMEM budgets ---------------------------------------------------------------------
#
# The kernel asks Mosaic for `vmem_limit_bytes` = the budget of the target it is compiled for and
# sizes its blocks so that `vmem_bytes(...)` stays within it. Budget = half of one TensorCore's
# VMEM, for the generations the kernel has been compiled for (the other half stays with XLA,
# whose memory-space assignment keeps neighbouring operands in VMEM). Measured with libtpu
# 0.0.42.1: VMEM per core 128 MiB (v5e, v6e) / 64 MiB (v5p); the scoped limit a Mosaic call gets
# when it asks for none is 16 MiB (v5e, v5p) / 32 MiB (v6e).
_MiB = 1 << 20
VMEM_BUDGET_BYTES = {"v5e": 64 * _MiB, "v6e": 64 * _MiB, "v5p": 32 * _MiB}
# Any other or unknown target (tracing without TPU devices in sight, other generations): the
# smallest default scoped limit (v5e/v5p), which every generation's VMEM holds.
FALLBACK_VMEM_BUDGET_BYTES = 16 * _MiB
# Scalar prefetch (seq_lens, cu_q_lens, the flattened page tables, num_seqs, first sequence of each
# q block) lives in SMEM: 1 MiB per core on v5e/v6e/v5p, a little of which the compiler keeps.
SMEM_BUDGET_BYTES = 960 * 1024
# Device kinds (jax Device.device_kind) of the generations above.
_DEVICE_KIND_TO_TARGET = {
    "TPU v5 lite": "v5e", "TPU v5e": "v5e",
    "TPU v5": "v5p", "TPU v5p": "v5p",
    "TPU v6 lite": "v6e", "TPU v6e": "v6e",
}


def tpu_target(x: jax.Array | None = None) -> str | None:
    """The TPU generation ("v5e", "v6e", "v5p", or another chip name) the kernel is traced for.

    Read first from the abstract mesh of `x`'s sharding (set when the arguments carry a
    NamedSharding over TPU devices, and inside `shard_map` over a TPU mesh: this is what
    compile-only topologies give), then from `pltpu.get_tpu_info()` (the mesh context or the
    default device). None when neither names a TPU (e.g. a CPU process running the interpreter).
    """
    if x is not None:
        mesh = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
        device = getattr(mesh, "abstract_device", None)
        kind = getattr(device, "device_kind", None)
        if kind is not None and getattr(device, "platform", "tpu") == "tpu":
            return _DEVICE_KIND_TO_TARGET.get(kind, kind)
    try:
        return str(pltpu.get_tpu_info().chip_version)
    except Exception:  # not a TPU (or a jax without TPU info): no target
        return None


def vmem_budget_bytes(target: str | None) -> int:
    """Scoped VMEM the kernel requests and fits its blocks into on `target` (see tpu_target)."""
    return VMEM_BUDGET_BYTES.get(target, FALLBACK_VMEM_BUDGET_BYTES)


def squeeze_kv_heads(num_kv_heads: int, dtype) -> bool:
    """Whether the kernel takes a single-head 16- or 8-bit cache as [P, ps, D] (dropping the unit axis).

    XLA's default TPU layout of a 16-bit (or 8-bit) [P, ps, 1, D] array moves the unit axis out of
    the tiled minor pair ({3,1,2,0}); a row-major [P, ps, 1, D] kernel operand would then cost a
    relayout copy of the whole cache on every call, while dropping the axis is a bitcast. f32 keeps
    the axis: its default layout is row-major with (1, 128) tiles, which the 4-D operand takes as is
    (a 3-D operand would be retiled). Checked in tests/kernels/test_rpa_tpu_compile.py.
    """
    return num_kv_heads == 1 and jnp.dtype(dtype).itemsize < 4


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _tile_bytes(shape: tuple[int, ...], itemsize: int, *, sublanes: int | None = None) -> int:
    """Bytes of a VMEM array in Mosaic's tiled layout: the minor dim padded to 128 lanes, the
    second-minor to the sublane tiling. Scratch (`sublanes=None`) gets Mosaic's inferred tiling:
    packing (4 // itemsize) rows, doubled while below min(rows, 8) (so [.., 1, D] f32 is not padded
    to 8 rows); pipelined blocks (`sublanes=8 * packing`) keep the HBM operand's native tile."""
    *lead, rows, lanes = shape
    if sublanes is None:
        sublanes = 4 // itemsize
        while sublanes < min(rows, 8):
            sublanes *= 2
    return math.prod(lead) * _round_up(rows, sublanes) * _round_up(lanes, _LANES) * itemsize


def vmem_bytes(
    *, head_dim: int, num_kv_heads: int, group: int, page_size: int, block_q: int,
    pages_per_block: int, dtype, page_dtype=None, v_head_dim: int | None = None,
) -> int:
    """VMEM the kernel needs (an upper bound), from its parameters alone.

    Explicit buffers, each in its tiled layout (`_tile_bytes`), rows = block_q * group,
    BK = pages_per_block * page_size:
      q and o blocks  [KVH, rows, D] dtype, double-buffered by the pipeline     4 x
      K/V page buffers [2, NPB, ps, KVH, D] dtype (two slots)                   2 x (1 x shared)
      m, l scratch    [KVH, rows, 128] f32                                      2 x
      acc scratch     [KVH, rows, D] f32                                        1 x
    (`v_head_dim` set: the values are the K rows' first lanes, no V buffers; o and acc are that wide)
    plus the values Mosaic keeps in VMEM while it computes one kv block (the head loop is
    unrolled, and live ranges of different heads overlap), in f32 bytes:
      shared:   4 x [rows, BK] (token/pos/kv_pos/mask) + [BK, D] (kv_real)
      per head: 2 x [BK, D] (k, v) + 2 x [rows, BK] (logits, p) + 4 x [rows, D] (q, pv, acc...)
    plus 256 KiB for Mosaic's internal scratch. The value term is empirical: it bounds what
    libtpu 0.0.42.1 reports for the compiled kernel on v5e, v6e and v5p
    (tests/kernels/test_rpa_tpu_compile.py checks that it still does).
    """
    page_dtype = jnp.dtype(page_dtype or dtype)
    quantized = is_quantized(page_dtype)
    # 8-bit pages: their buffers tile 32 rows of 1 byte where 16-bit ones tile 16 rows of 2 (the same
    # bytes for the few-head pages here), and they are widened to `dtype` before use: size as `dtype`.
    itemsize = jnp.dtype(dtype).itemsize
    rows = block_q * group
    block_kv = pages_per_block * page_size
    d, bk, r = _round_up(head_dim, _LANES), _round_up(block_kv, _LANES), _round_up(rows, 8)
    shared = v_head_dim is not None
    dv = v_head_dim or head_dim
    qo = sum(2 * _tile_bytes((num_kv_heads, rows, width), itemsize, sublanes=8 * (4 // itemsize))
             for width in (head_dim, dv))
    kv_page = (
        (page_size, head_dim) if squeeze_kv_heads(num_kv_heads, page_dtype)
        else (page_size, num_kv_heads, head_dim)
    )
    buffers = 1 if shared else 2
    kv = buffers * _tile_bytes((2, pages_per_block, *kv_page), itemsize)
    if quantized:
        # scale buffers [2, NPB, KVH, ps] f32, and per head the widened K/V [BK, D], two scale
        # rows with their one-hot spread [ps, BK] and tiled [NPB, BK] products
        kv += buffers * _tile_bytes((2, pages_per_block, num_kv_heads, page_size), 4)
        kv += num_kv_heads * 4 * (2 * _round_up(block_kv, 8) * _round_up(head_dim, _LANES)
                                  + 2 * (_round_up(page_size, 8) + _round_up(pages_per_block, 8) + 8)
                                  * _round_up(block_kv, _LANES))
    ml = 2 * _tile_bytes((num_kv_heads, rows, _LANES), 4)
    acc = _tile_bytes((num_kv_heads, rows, dv), 4)
    shared = 4 * (4 * r * bk + _round_up(block_kv, 8) * d)
    per_head = 4 * (2 * _round_up(block_kv, 8) * d + 2 * r * bk + 4 * r * d)
    values = shared + num_kv_heads * per_head
    if (itemsize < 4 or quantized) and not squeeze_kv_heads(num_kv_heads, page_dtype):
        # A 16-bit head is every KVH-th row of sublane-packed [ps, KVH, D] tiles: Mosaic unpacks
        # it through f32 copies (on v5e/v5p, which have no bf16 VPU, up to ~10 [BK, 128] f32
        # arrays per head, for at most ~4 heads at a time).
        values += min(num_kv_heads, 4) * 10 * _round_up(block_kv, 16) * _LANES * 4
    return qo + kv + ml + acc + values + 256 * 1024


def smem_bytes(*, max_seqs: int, max_pages_per_seq: int, num_q_blocks: int, num_sinks: int = 0) -> int:
    """SMEM bytes of the scalar prefetch (seq_lens, cu_q_lens, page tables, num_seqs, first_seq)
    and of the sinks [H] f32 when there are any."""
    return 4 * sum(
        _round_up(n, 128)
        for n in (max_seqs, max_seqs + 1, max_seqs * max_pages_per_seq, 1, num_q_blocks, num_sinks)
    )


def _shrink_block_q(block_q: int, group: int) -> int | None:
    """Half of block_q if the q block keeps a whole number of 16-row tiles, else None."""
    half = block_q // 2
    if block_q % 2 or half < 1 or (half * group) % 16:
        return None
    return half


def choose_blocks(
    *, head_dim: int, num_kv_heads: int, group: int, page_size: int, max_pages_per_seq: int,
    dtype, budget: int, block_q: int | None = None, pages_per_block: int | None = None,
    target: str | None = None, page_dtype=None, v_head_dim: int | None = None,
) -> tuple[int, int]:
    """(block_q, pages_per_block) whose `vmem_bytes` fits `budget`.

    Defaults start at ~128 q rows x ~128 keys (default_block_q / default_pages_per_block); while
    over budget, block_q halves (keeping whole 16-row tiles), then pages_per_block halves. Sizes
    the caller passes are kept as they are. Raises ValueError naming the parameters when nothing
    fits.
    """
    bq = block_q or default_block_q(group)
    npb = pages_per_block or default_pages_per_block(page_size, max_pages_per_seq)
    explicit = bool(block_q or pages_per_block)

    def need(bq, npb):
        return vmem_bytes(
            head_dim=head_dim, num_kv_heads=num_kv_heads, group=group, page_size=page_size,
            block_q=bq, pages_per_block=npb, dtype=dtype, page_dtype=page_dtype, v_head_dim=v_head_dim,
        )

    while need(bq, npb) > budget:
        smaller_q = None if block_q else _shrink_block_q(bq, group)
        if smaller_q is not None:
            bq = smaller_q
        elif not pages_per_block and npb > 1:
            npb //= 2
        else:
            raise ValueError(
                "ragged_paged_attention_tpu does not fit in VMEM: "
                f"head_dim={head_dim}, num_kv_heads={num_kv_heads}, group={group}, "
                f"page_size={page_size}, block_q={bq}, pages_per_block={npb}, "
                f"dtype={jnp.dtype(dtype).name} need {need(bq, npb)} bytes of VMEM but the budget "
                f"for target {target or 'unknown'} is {budget} bytes"
                + ("; pass a smaller block_q / pages_per_block" if explicit else "")
            )
    return bq, npb


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale", "sliding_window", "soft_cap", "block_q", "pages_per_block", "interpret", "v_head_dim",
    ),
)
def ragged_paged_attention_tpu(
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
    pages_per_block: int | None = None,
    interpret: bool = False,
    k_scales: jax.Array | None = None,  # [P, KVH, ps] float32 for quantized pages (kv_quant.py)
    v_scales: jax.Array | None = None,
    sinks: jax.Array | None = None,  # [H] float32: one value-less logit per q head (gpt-oss)
    v_head_dim: int | None = None,
) -> jax.Array:  # [T, H, Dv]
    """Ragged paged attention on TPU (see docs/CONTRACTS.md); `interpret` runs the TPU interpreter."""
    dims = check_attention_args(
        q, k_pages, v_pages, seq_lens, cu_q_lens, page_tables, num_seqs,
        sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
        k_scales=k_scales, v_scales=v_scales, sinks=sinks, v_head_dim=v_head_dim,
    )
    quantized = k_scales is not None
    shared = v_pages is None
    Dv = dims.v_head_dim
    check_block_arg("block_q", block_q)
    check_block_arg("pages_per_block", pages_per_block)
    T, H, D = q.shape
    KVH, G, MP, S = dims.num_kv_heads, dims.group, dims.max_pages_per_seq, dims.max_seqs
    target = None if interpret else tpu_target(q)
    budget = vmem_budget_bytes(target)
    bq, npb = choose_blocks(
        head_dim=D, num_kv_heads=KVH, group=G, page_size=dims.page_size, max_pages_per_seq=MP,
        dtype=q.dtype, budget=budget, block_q=block_q, pages_per_block=pages_per_block,
        target=target, page_dtype=k_pages.dtype, v_head_dim=Dv if shared else None,
    )
    num_q_blocks = -(-T // bq)
    smem = smem_bytes(max_seqs=S, max_pages_per_seq=MP, num_q_blocks=num_q_blocks,
                      num_sinks=0 if sinks is None else H)
    if smem > SMEM_BUDGET_BYTES:
        raise ValueError(
            "ragged_paged_attention_tpu: the scalar-prefetched page tables do not fit in SMEM: "
            f"max_seqs={S} x max_pages_per_seq={MP} (page_size={dims.page_size}), "
            f"{num_q_blocks} q blocks need {smem} bytes of SMEM, budget {SMEM_BUDGET_BYTES} bytes; "
            "use fewer rows, a shorter max context or larger pages"
        )
    t_pad = num_q_blocks * bq

    # [T, H, D] -> [KVH, T_pad * G, D]; padded rows belong to no sequence and come out as 0.
    q_t = jnp.pad(q, ((0, t_pad - T), (0, 0), (0, 0))).reshape(t_pad, KVH, G, D)
    q_t = q_t.transpose(1, 0, 2, 3).reshape(KVH, t_pad * G, D)
    block_starts = jnp.arange(num_q_blocks, dtype=jnp.int32) * bq
    seq_of_block, live = row_to_seq(cu_q_lens, num_seqs, block_starts)
    first_seq = jnp.where(live, seq_of_block, num_seqs[0]).astype(jnp.int32)

    rows = bq * G
    kernel = functools.partial(
        _kernel, sm_scale=float(sm_scale), sliding_window=sliding_window, soft_cap=soft_cap,
        block_q=bq, group=G, max_pages=MP, shared=shared, quantized=quantized, has_sinks=sinks is not None,
    )
    pages = (k_pages,) if shared else (k_pages, v_pages)
    if squeeze_kv_heads(KVH, k_pages.dtype):
        pages = tuple(p.reshape(p.shape[0], dims.page_size, D) for p in pages)
    buf = pltpu.VMEM((2, npb, *pages[0].shape[1:]), k_pages.dtype)
    scales = () if not quantized else (k_scales,) if shared else (k_scales, v_scales)
    scale_bufs = [pltpu.VMEM((2, npb, KVH, dims.page_size), jnp.float32)] * len(scales)
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    sink_in = () if sinks is None else (sinks,)
    smem_in = [pl.BlockSpec(memory_space=pltpu.SMEM)] * len(sink_in)
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=5,
            grid=(num_q_blocks,),
            in_specs=[pl.BlockSpec((KVH, rows, D), lambda b, *_: (0, b, 0)),
                      *[hbm] * (len(pages) + len(scales)), *smem_in],
            out_specs=pl.BlockSpec((KVH, rows, Dv), lambda b, *_: (0, b, 0)),
            scratch_shapes=[
                *[buf] * len(pages),
                *scale_bufs,
                pltpu.SemaphoreType.DMA((len(pages) + len(scales), 2)),
                pltpu.VMEM((KVH, rows, _LANES), jnp.float32),
                pltpu.VMEM((KVH, rows, _LANES), jnp.float32),
                pltpu.VMEM((KVH, rows, Dv), jnp.float32),
            ],
        ),
        out_shape=jax.ShapeDtypeStruct((KVH, t_pad * G, Dv), q.dtype),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel",), vmem_limit_bytes=budget,
        ),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="ragged_paged_attention_tpu",
    )(seq_lens, cu_q_lens, page_tables.reshape(S * MP), num_seqs, first_seq,
      q_t, *pages, *scales, *sink_in)
    out = out.reshape(KVH, t_pad, G, Dv).transpose(1, 0, 2, 3).reshape(t_pad, H, Dv)
    return out[:T]
