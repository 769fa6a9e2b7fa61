"""The jnp reference against a plain numpy per-sequence softmax (its oracle)."""
import jax.numpy as jnp
import numpy as np
import pytest
from rpa_cases import MIXED, assert_close, fresh_rng, fresh_seed, make_case, numpy_oracle, scramble_padding

from kernels_pallas.ragged_paged_attention_reference import (
    ragged_paged_attention_reference,
    row_to_seq,
)

DIMS = dict(num_q_heads=4, num_kv_heads=2, head_dim=8, page_size=4)


def _run(case, dtype=jnp.float32, **kw):
    return ragged_paged_attention_reference(*case.args(dtype), sm_scale=case.sm_scale, **kw)


@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(sliding_window=3, chunk_pages=1),  # several online-softmax chunks
        dict(soft_cap=1.5),
    ],
    ids=["one_chunk", "sliding_window_chunked", "soft_cap"],
)
def test_reference_matches_numpy_oracle(kw):
    rng = fresh_rng()
    case = make_case(rng, MIXED, max_seqs=7, extra_rows=2, **DIMS)
    out = np.asarray(_run(case, **kw))
    oracle_kw = {k: v for k, v in kw.items() if k != "chunk_pages"}
    assert_close(out[: case.num_live_rows], numpy_oracle(case, **oracle_kw), rtol=1e-5)


def test_reference_padding_rows_are_finite_zero_and_padding_seqs_ignored():
    rng = fresh_rng()
    case = make_case(rng, MIXED, max_seqs=7, extra_rows=2, **DIMS)
    scramble_padding(case)  # garbage in the padding sequences' metadata must not matter
    out = np.asarray(_run(case))
    live = case.num_live_rows
    assert np.all(np.isfinite(out))
    assert np.all(out[live:] == 0.0)
    assert_close(out[:live], numpy_oracle(case), rtol=1e-5)


def test_reference_ignores_nan_outside_live_slots():
    seed = fresh_seed()
    clean = make_case(np.random.default_rng(seed), MIXED, max_seqs=7, extra_rows=2, **DIMS)
    poisoned = make_case(np.random.default_rng(seed), MIXED, max_seqs=7, extra_rows=2, poison=True,
                         **DIMS)
    assert np.isnan(poisoned.k_pages).any()
    kw = dict(sliding_window=3, chunk_pages=1)  # same compile as the oracle test above
    out_clean = np.asarray(_run(clean, **kw))
    out_poisoned = np.asarray(_run(poisoned, **kw))
    assert np.all(np.isfinite(out_poisoned))
    np.testing.assert_array_equal(out_poisoned, out_clean)


def test_reference_bf16_close_to_oracle():
    rng = fresh_rng()
    case = make_case(rng, MIXED, max_seqs=7, extra_rows=2, **DIMS)
    out = _run(case, jnp.bfloat16)
    assert out.dtype == jnp.bfloat16
    oracle = numpy_oracle(case, dtype=jnp.bfloat16)
    assert_close(np.asarray(out)[: case.num_live_rows], oracle, rtol=1e-2)


def test_row_to_seq_skips_empty_and_padding_sequences():
    # seq 1 is empty, seqs 3.. are padding with garbage offsets.
    cu = jnp.array([0, 2, 2, 5, 1, 0], jnp.int32)
    seq, live = row_to_seq(cu, jnp.array([3], jnp.int32), jnp.arange(7, dtype=jnp.int32))
    np.testing.assert_array_equal(np.asarray(seq)[:5], [0, 0, 2, 2, 2])
    np.testing.assert_array_equal(np.asarray(live), [1, 1, 1, 1, 1, 0, 0])
