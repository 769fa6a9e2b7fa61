"""TPU (Mosaic) kernel == reference. CPU runs use the TPU interpreter (slow: few, tiny cases);
`tpu`-marked tests compile the real kernel at serving sizes."""
import jax.numpy as jnp
import numpy as np
import pytest
from rpa_cases import MIXED, SMALL, assert_close, fresh_rng, make_case, scramble_padding

from kernels_pallas.ragged_paged_attention_reference import ragged_paged_attention_reference
from kernels_pallas.ragged_paged_attention_tpu import ragged_paged_attention_tpu


def _check(case, *, dtype=jnp.float32, rtol=1e-5, interpret=True, kernel_kw=None, **kw):
    args = case.args(dtype)
    out = ragged_paged_attention_tpu(
        *args, sm_scale=case.sm_scale, interpret=interpret, **(kernel_kw or {}), **kw
    )
    ref = ragged_paged_attention_reference(*args, sm_scale=case.sm_scale, **kw)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    out = np.asarray(out.astype(jnp.float32))
    live = case.num_live_rows
    assert np.all(np.isfinite(out)), "padding or live rows are not finite"
    assert_close(out[:live], np.asarray(ref.astype(jnp.float32))[:live], rtol=rtol)
    return out


def test_tpu_mixed_batch_with_poison_and_padding_matches_reference():
    # q blocks of 4 rows span several sequences; one page per kv block, so the double-buffered
    # fetch runs across kv blocks and across sequences.
    rng = fresh_rng()
    case = make_case(rng, MIXED, num_q_heads=8, max_seqs=7, extra_rows=3, poison=True, **SMALL)
    scramble_padding(case)
    out = _check(case, kernel_kw=dict(block_q=4, pages_per_block=1))
    assert np.all(out[case.num_live_rows:] == 0.0)


def test_tpu_gqa8_bf16_sliding_window_matches_reference():
    # Two-row q blocks and one-page kv blocks: the window start skips whole kv blocks.
    rng = fresh_rng()
    case = make_case(rng, MIXED, num_q_heads=16, max_seqs=6, **SMALL)
    _check(case, dtype=jnp.bfloat16, rtol=1e-2, kernel_kw=dict(block_q=2, pages_per_block=1),
           sliding_window=5)


# --- real TPU: serving sizes, compiled Mosaic kernel ---------------------------------------

@pytest.mark.tpu
@pytest.mark.parametrize("dtype,rtol", [(jnp.float32, 1e-5), (jnp.bfloat16, 1e-2)])
@pytest.mark.parametrize(
    "kw", [dict(), dict(sliding_window=100), dict(soft_cap=30.0)],
    ids=["plain", "sliding_window", "soft_cap"],
)
def test_tpu_device_mixed_batch_matches_reference(dtype, rtol, kw):
    rng = fresh_rng()
    seqs = [(1, int(n)) for n in rng.integers(1, 1500, 12)] + [(200, 700), (64, 64), (33, 1025)]
    case = make_case(rng, seqs, num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=16,
                     max_seqs=20, extra_rows=5, spare_pages=40, poison=True)
    out = _check(case, dtype=dtype, rtol=rtol, interpret=False, **kw)
    assert np.all(out[case.num_live_rows:] == 0.0)
