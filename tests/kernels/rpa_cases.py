"""Random ragged paged attention inputs and a plain numpy oracle, shared by the kernel tests."""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

# (q_len, context_len) per sequence at page_size 4: decode mid-page / on a boundary, a chunk over a
# context ending on a boundary, a fresh prefill ending mid-page, a chunk ending mid-page
MIXED = [(1, 7), (1, 8), (5, 12), (6, 6), (3, 10)]
SMALL = dict(num_kv_heads=2, head_dim=16, page_size=4)


@dataclasses.dataclass
class Case:
    q: np.ndarray  # [T, H, D]
    k_pages: np.ndarray  # [P, ps, KVH, D]
    v_pages: np.ndarray  # [P, ps, KVH, D]
    seq_lens: np.ndarray  # [S] int32
    cu_q_lens: np.ndarray  # [S + 1] int32
    page_tables: np.ndarray  # [S, MP] int32
    num_seqs: np.ndarray  # [1] int32
    sm_scale: float
    live_slots: np.ndarray | None = None  # [P, ps] bool: the slot holds a live token

    def args(self, dtype=jnp.float32) -> tuple:
        return (
            jnp.asarray(self.q, dtype),
            jnp.asarray(self.k_pages, dtype),
            jnp.asarray(self.v_pages, dtype),
            jnp.asarray(self.seq_lens),
            jnp.asarray(self.cu_q_lens),
            jnp.asarray(self.page_tables),
            jnp.asarray(self.num_seqs),
        )

    @property
    def num_live_rows(self) -> int:
        return int(self.cu_q_lens[int(self.num_seqs[0])])


def fresh_seed() -> int:
    """A new random seed each run, printed so a failure can be replayed."""
    seed = int(np.random.SeedSequence().entropy % (1 << 63))
    print(f"rpa_cases seed={seed}")
    return seed


def fresh_rng() -> np.random.Generator:
    return np.random.default_rng(fresh_seed())


def make_case(
    rng: np.random.Generator,
    seqs: list[tuple[int, int]],  # (q_len, seq_len) per live sequence
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    max_seqs: int | None = None,
    max_pages_per_seq: int | None = None,
    extra_rows: int = 0,
    spare_pages: int = 3,
    poison: bool = False,
) -> Case:
    """Pages are handed out from a shuffled pool, so page tables are non-contiguous.

    With `poison`, every K/V slot that holds no live token (spare pages, table padding, and the
    tail of each sequence's last page) is NaN, and table padding points at spare pages.
    """
    num_live = len(seqs)
    max_seqs = max_seqs or num_live
    pages_needed = [-(-seq_len // page_size) for _, seq_len in seqs]
    max_pages = max_pages_per_seq or max(pages_needed)
    num_pages = sum(pages_needed) + spare_pages
    pool = rng.permutation(num_pages).astype(np.int32)
    spare = pool[sum(pages_needed):]

    page_tables = np.empty((max_seqs, max_pages), np.int32)
    # Padding entries point somewhere real but unused (spare pages), never out of range.
    page_tables[:] = rng.choice(spare, size=page_tables.shape) if len(spare) else 0
    k_pages = rng.standard_normal((num_pages, page_size, num_kv_heads, head_dim)).astype(np.float32)
    v_pages = rng.standard_normal((num_pages, page_size, num_kv_heads, head_dim)).astype(np.float32)
    live_slot = np.zeros((num_pages, page_size), bool)
    at = 0
    for s, (n, (_, seq_len)) in enumerate(zip(pages_needed, seqs)):
        own = pool[at:at + n]
        at += n
        page_tables[s, :n] = own
        for i, page in enumerate(own):
            live_slot[page, : min(page_size, seq_len - i * page_size)] = True
    if poison:
        k_pages[~live_slot] = np.nan
        v_pages[~live_slot] = np.nan

    q_lens = [q_len for q_len, _ in seqs]
    cu = np.zeros(max_seqs + 1, np.int32)
    cu[1:num_live + 1] = np.cumsum(q_lens)
    cu[num_live + 1:] = cu[num_live]
    seq_lens = np.zeros(max_seqs, np.int32)
    seq_lens[:num_live] = [seq_len for _, seq_len in seqs]
    num_tokens = int(cu[num_live]) + extra_rows
    q = rng.standard_normal((num_tokens, num_q_heads, head_dim)).astype(np.float32)
    return Case(
        q=q, k_pages=k_pages, v_pages=v_pages, seq_lens=seq_lens, cu_q_lens=cu,
        page_tables=page_tables, num_seqs=np.array([num_live], np.int32),
        sm_scale=float(head_dim) ** -0.5, live_slots=live_slot,
    )


def scramble_padding(case: Case) -> None:
    """Garbage metadata in the padding sequences (past num_seqs), which no backend may read."""
    n = int(case.num_seqs[0])
    case.seq_lens[n:] = 10_000
    case.cu_q_lens[n + 1:] = np.arange(len(case.cu_q_lens) - n - 1, 0, -1)
    case.page_tables[n:] = -7


def numpy_oracle(
    case: Case, *, sliding_window: int | None = None, soft_cap: float | None = None,
    dtype=np.float32, sinks: np.ndarray | None = None,
) -> np.ndarray:
    """Dense softmax per sequence, in float64, written plainly. Rows of live tokens only.

    `dtype` rounds q/K/V first (as the device arrays are rounded) so bf16 comparisons are fair.
    `sinks` [H]: head h's softmax gets one more logit, sinks[h], whose value vector is zero.
    """
    def rounded(x):
        return np.asarray(jnp.asarray(x, dtype).astype(jnp.float32), np.float64)

    q, kp, vp = rounded(case.q), rounded(case.k_pages), rounded(case.v_pages)
    num_heads = q.shape[1]
    group = num_heads // kp.shape[2]
    page_size = kp.shape[1]
    out = np.zeros((case.num_live_rows, num_heads, q.shape[2]))
    for s in range(int(case.num_seqs[0])):
        seq_len = int(case.seq_lens[s])
        start, end = int(case.cu_q_lens[s]), int(case.cu_q_lens[s + 1])
        pages = case.page_tables[s, : -(-seq_len // page_size)]
        k = kp[pages].reshape(-1, kp.shape[2], kp.shape[3])[:seq_len]  # [L, KVH, D]
        v = vp[pages].reshape(-1, vp.shape[2], vp.shape[3])[:seq_len]
        for i, row in enumerate(range(start, end)):
            pos = seq_len - (end - start) + i
            lo = 0 if sliding_window is None else max(0, pos - sliding_window + 1)
            for h in range(num_heads):
                kh, vh = k[lo:pos + 1, h // group], v[lo:pos + 1, h // group]
                logits = kh @ q[row, h] * case.sm_scale
                if soft_cap is not None:
                    logits = soft_cap * np.tanh(logits / soft_cap)
                sink = -np.inf if sinks is None else float(sinks[h])
                top = max(logits.max(), sink)
                w = np.exp(logits - top)
                out[row, h] = (w @ vh) / (w.sum() + np.exp(sink - top))
    return out


def make_sinks(rng: np.random.Generator, num_q_heads: int) -> np.ndarray:
    """[H] float32 sink logits spread around the scale of the test logits, some far above them
    (the sink takes most of that head's mass) and some far below (it takes almost none)."""
    sinks = rng.normal(0.0, 2.0, num_q_heads)
    sinks[::3] += 6.0
    sinks[1::4] -= 8.0
    return sinks.astype(np.float32)


def assert_close(got, want, *, rtol: float, what: str = "") -> None:
    """allclose with an absolute floor scaled to the output size: atol = rtol * max|want|."""
    got = np.asarray(jnp.asarray(got).astype(jnp.float32), np.float64)
    want = np.asarray(want, np.float64)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    assert np.all(np.isfinite(got)), f"{what}: non-finite output"
    atol = rtol * float(np.max(np.abs(want)))
    err = np.abs(got - want)
    bad = err > atol + rtol * np.abs(want)
    assert not bad.any(), (
        f"{what}: {int(bad.sum())} of {bad.size} values off; max abs err {err.max():.3g}, "
        f"atol {atol:.3g}"
    )


def check_against_reference(fn, case: Case, *, dtype=jnp.float32, rtol: float = 1e-5, **kw) -> np.ndarray:
    """fn(case) equals the reference on every live row, is finite, and leaves padding rows zero; the
    output as float32 numpy. kw go to both (window, soft cap), and block_q to fn alone."""
    from kernels_pallas.ragged_paged_attention_reference import ragged_paged_attention_reference

    args = case.args(dtype)
    out = fn(*args, sm_scale=case.sm_scale, **kw)
    kw.pop("block_q", None)
    ref = ragged_paged_attention_reference(*args, sm_scale=case.sm_scale, **kw)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    out = np.asarray(out.astype(jnp.float32))
    live = case.num_live_rows
    assert np.all(np.isfinite(out))
    assert_close(out[:live], np.asarray(ref.astype(jnp.float32))[:live], rtol=rtol)
    assert np.all(out[live:] == 0.0)
    return out


def quantized_args(case: Case, page_dtype, dtype=jnp.float32) -> tuple[tuple, dict, tuple]:
    """(args with 8-bit pages, their scales as kwargs, args with those pages dequantized to `dtype`):
    the dequantized pages are what any backend reading the quantized ones must attend over."""
    from kernels_pallas.kv_quant import dequantize_pages, quantize

    q, k, v, *meta = case.args(jnp.float32)
    kq, ks = quantize(k, page_dtype)  # scales [P, ps, KVH] -> stored [P, KVH, ps]
    vq, vs = quantize(v, page_dtype)
    scales = dict(k_scales=jnp.swapaxes(ks, 1, 2), v_scales=jnp.swapaxes(vs, 1, 2))
    plain = (q.astype(dtype), dequantize_pages(kq, scales["k_scales"]).astype(dtype),
             dequantize_pages(vq, scales["v_scales"]).astype(dtype), *meta)
    return (q.astype(dtype), kq, vq, *meta), scales, plain
