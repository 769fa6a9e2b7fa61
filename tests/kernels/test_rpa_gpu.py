"""GPU (Triton) kernel == reference. CPU runs use the Pallas interpreter at tiny shapes;
`gpu`-marked tests compile the real kernel at serving sizes."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from rpa_cases import MIXED, SMALL, assert_close, fresh_rng, fresh_seed, make_case, scramble_padding

from kernels_pallas.ragged_paged_attention_gpu import ragged_paged_attention_gpu, work_items
from kernels_pallas.ragged_paged_attention_reference import ragged_paged_attention_reference

DECODE = [(1, 3), (1, 4), (1, 9), (1, 16), (1, 1)]
CHUNKS = [(7, 7), (6, 13), (2, 16)]
# Several q tiles per sequence and several kv blocks per tile.
BLOCKS = dict(block_q=2, block_kv=4)  # one 4-token page per kv block


def _check(case, *, dtype=jnp.float32, rtol=1e-5, interpret=True, kernel_kw=None, **kw):
    args = case.args(dtype)
    out = ragged_paged_attention_gpu(
        *args, sm_scale=case.sm_scale, interpret=interpret, **(kernel_kw or {}), **kw
    )
    ref = ragged_paged_attention_reference(*args, sm_scale=case.sm_scale, **kw)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    out = np.asarray(out.astype(jnp.float32))
    live = case.num_live_rows
    assert np.all(np.isfinite(out)), "padding or live rows are not finite"
    assert_close(out[:live], np.asarray(ref.astype(jnp.float32))[:live], rtol=rtol)
    return out


# One compile per scenario (the interpreter compiles slowly), each covering several properties.
SCENARIOS = {
    "gqa1_decode": dict(seqs=DECODE, group=1),
    "gqa2_chunks": dict(seqs=CHUNKS, group=2),
    "gqa4_mixed_padding": dict(seqs=MIXED, group=4, max_seqs=7, extra_rows=3),
    "gqa8_mixed_window": dict(seqs=MIXED, group=8, max_seqs=6, kw=dict(sliding_window=5)),
    "gqa3_default_blocks_soft_cap": dict(seqs=MIXED, group=3, max_seqs=6, extra_rows=1,
                                         blocks={}, kw=dict(soft_cap=2.0)),
}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_gpu_matches_reference(name):
    sc = SCENARIOS[name]
    rng = fresh_rng()
    case = make_case(rng, sc["seqs"], num_q_heads=2 * sc["group"],
                     max_seqs=sc.get("max_seqs", len(sc["seqs"]) + 1),
                     extra_rows=sc.get("extra_rows", 0), **SMALL)
    if sc.get("max_seqs", 0) > len(sc["seqs"]):
        scramble_padding(case)
    if "soft_cap" in sc.get("kw", {}):
        case.q *= 4.0  # large logits, so the cap matters
    out = _check(case, kernel_kw=sc.get("blocks", BLOCKS), **sc.get("kw", {}))
    assert np.all(out[case.num_live_rows:] == 0.0)


def test_gpu_bf16_matches_reference():
    rng = fresh_rng()
    case = make_case(rng, MIXED, num_q_heads=4, max_seqs=7, extra_rows=2, **SMALL)
    _check(case, dtype=jnp.bfloat16, rtol=1e-2, kernel_kw=BLOCKS)


def test_gpu_ignores_nan_outside_live_slots():
    seed = fresh_seed()
    kw = dict(num_q_heads=8, max_seqs=7, extra_rows=3, **SMALL)  # same shapes as gqa4_mixed_padding
    clean = make_case(np.random.default_rng(seed), MIXED, **kw)
    poisoned = make_case(np.random.default_rng(seed), MIXED, poison=True, **kw)
    assert np.isnan(poisoned.v_pages).any()
    out_clean = _check(clean, kernel_kw=BLOCKS)
    out_poisoned = _check(poisoned, kernel_kw=BLOCKS)
    np.testing.assert_array_equal(out_poisoned, out_clean)


def test_work_items_tile_every_live_row_once():
    cu = jnp.array([0, 1, 6, 6, 9, 9], jnp.int32)  # q_lens 1, 5, 0, 3; one padding seq
    seq_lens = jnp.array([4, 8, 2, 3, 0], jnp.int32)
    items = jax.jit(work_items, static_argnames=("block_q", "num_items"))
    seq, row, n, pos = map(np.asarray, items(
        cu, seq_lens, jnp.array([4], jnp.int32), block_q=2, num_items=-(-9 // 2) + 5))
    covered = [r for s, r0, k in zip(seq, row, n) for r in range(r0, r0 + k)]
    assert sorted(covered) == list(range(9))
    real = n > 0
    np.testing.assert_array_equal(seq[real], [0, 1, 1, 1, 3, 3])
    np.testing.assert_array_equal(pos[real], [3, 3, 5, 7, 0, 2])


# --- real GPU: serving sizes, compiled Triton kernel ---------------------------------------

GPU_DIMS = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=16)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,rtol", [(jnp.float32, 1e-5), (jnp.bfloat16, 1e-2)])
@pytest.mark.parametrize(
    "kw", [dict(), dict(sliding_window=100), dict(soft_cap=30.0)],
    ids=["plain", "sliding_window", "soft_cap"],
)
def test_gpu_device_mixed_batch_matches_reference(dtype, rtol, kw):
    rng = fresh_rng()
    seqs = [(1, int(n)) for n in rng.integers(1, 1500, 12)] + [(200, 700), (64, 64), (33, 1025)]
    case = make_case(rng, seqs, max_seqs=20, extra_rows=5, spare_pages=40, poison=True,
                     **GPU_DIMS)
    out = _check(case, dtype=dtype, rtol=rtol, interpret=False, **kw)
    assert np.all(out[case.num_live_rows:] == 0.0)


@pytest.mark.gpu
def test_gpu_device_decode_batch_matches_reference():
    rng = fresh_rng()
    seqs = [(1, int(n)) for n in rng.integers(1, 4096, 32)]
    case = make_case(rng, seqs, max_seqs=32, spare_pages=16, **GPU_DIMS)
    _check(case, dtype=jnp.bfloat16, rtol=1e-2, interpret=False)
