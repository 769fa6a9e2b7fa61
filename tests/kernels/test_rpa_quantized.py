"""Quantized KV pages (int8, float8 e4m3 / e5m2 with per-token scales): every backend attends over
them exactly as the reference attends over the same pages dequantized."""
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from rpa_cases import MIXED, SMALL, assert_close, fresh_rng, make_case, quantized_args, scramble_padding

from kernels_pallas import get_attention_backend
from kernels_pallas.kv_quant import dequantize_pages, quantize
from kernels_pallas.ragged_paged_attention_gpu import ragged_paged_attention_gpu
from kernels_pallas.ragged_paged_attention_reference import ragged_paged_attention_reference
from kernels_pallas.ragged_paged_attention_tpu import ragged_paged_attention_tpu

PAGE_DTYPES = [jnp.int8, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2]
BACKENDS = {
    "reference": ragged_paged_attention_reference,
    "tiled": get_attention_backend("tiled"),
    "cpu": get_attention_backend("cpu"),  # the native decode kernel reads int8 pages; float8 takes the jnp decode
    # interpreters; two pages per kv block so the TPU kernel builds multi-page scale rows
    "tpu_interpret": lambda *a, **kw: ragged_paged_attention_tpu(*a, interpret=True, block_q=4, pages_per_block=2, **kw),
    "gpu_interpret": lambda *a, **kw: ragged_paged_attention_gpu(*a, interpret=True, block_q=4, block_kv=8, **kw),
}


@pytest.mark.parametrize("page_dtype", PAGE_DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_quantize_round_trip_error_is_within_half_a_step(page_dtype):
    x = jnp.asarray(fresh_rng().standard_normal((64, 4, 32)) * 3, jnp.float32)
    values, scales = quantize(x, page_dtype)
    assert values.dtype == jnp.dtype(page_dtype) and scales.shape == (64, 4)
    back = np.asarray(values.astype(jnp.float32) * scales[..., None])
    absmax = np.abs(np.asarray(x)).max(-1, keepdims=True)
    if jnp.dtype(page_dtype) == jnp.int8:
        bound = absmax / 127 / 2                          # half an integer step
    else:                                                 # half an ulp of the mantissa, relative
        mant = ml_dtypes.finfo(page_dtype).nmant
        bound = np.maximum(np.abs(np.asarray(x)), absmax * 2.0 ** -6) * 2.0 ** -(mant + 1)
    assert np.all(np.abs(back - np.asarray(x)) <= bound * 1.0001 + 1e-7)
    # the largest entry of each head vector maps onto the format's largest value
    top = np.abs(np.asarray(values.astype(jnp.float32))).max(-1)
    assert np.allclose(top, float(ml_dtypes.finfo(page_dtype).max) if jnp.dtype(page_dtype) != jnp.int8 else 127)


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("page_dtype", PAGE_DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_backend_on_quantized_pages_matches_reference_on_dequantized(backend, page_dtype):
    rng = fresh_rng()
    case = make_case(rng, MIXED, num_q_heads=4, max_seqs=7, extra_rows=3, **SMALL)
    scramble_padding(case)
    args, scales, plain = quantized_args(case, page_dtype)
    out = BACKENDS[backend](*args, sm_scale=case.sm_scale, **scales)
    want = ragged_paged_attention_reference(*plain, sm_scale=case.sm_scale)
    live = case.num_live_rows
    assert_close(out[:live], np.asarray(want)[:live], rtol=1e-5, what=backend)
    assert np.all(np.asarray(out)[live:] == 0.0)


@pytest.mark.parametrize("backend", ["tiled", "cpu", "tpu_interpret"])
def test_bf16_queries_over_int8_pages_sliding_window(backend):
    rng = fresh_rng()
    case = make_case(rng, MIXED, num_q_heads=8, max_seqs=6, **SMALL)
    args, scales, plain = quantized_args(case, jnp.int8, jnp.bfloat16)
    out = BACKENDS[backend](*args, sm_scale=case.sm_scale, sliding_window=5, **scales)
    want = ragged_paged_attention_reference(*plain, sm_scale=case.sm_scale, sliding_window=5)
    assert out.dtype == jnp.bfloat16
    live = case.num_live_rows
    assert_close(out[:live], np.asarray(want.astype(jnp.float32))[:live], rtol=2e-2, what=backend)


def test_stale_scales_of_unused_slots_never_leak():
    """NaN in the scales of every slot no live token uses changes nothing, on every backend."""
    rng = fresh_rng()
    case = make_case(rng, MIXED, num_q_heads=4, max_seqs=6, **SMALL)
    args, scales, _ = quantized_args(case, jnp.int8)
    clean = ragged_paged_attention_reference(*args, sm_scale=case.sm_scale, **scales)
    dead = ~case.live_slots[:, None, :]                                            # [P, 1, ps] over heads
    poisoned = {name: jnp.where(dead, jnp.nan, s) for name, s in scales.items()}
    for name, fn in BACKENDS.items():
        out = fn(*args, sm_scale=case.sm_scale, **poisoned)
        assert_close(out[:case.num_live_rows], np.asarray(clean)[:case.num_live_rows], rtol=1e-5, what=name)


def test_dequantize_pages_layout():
    pages = jnp.arange(2 * 3 * 2 * 4, dtype=jnp.int8).reshape(2, 3, 2, 4)      # [P, ps, KVH, D]
    scales = jnp.arange(1, 13, dtype=jnp.float32).reshape(2, 2, 3)             # [P, KVH, ps]
    got = np.asarray(dequantize_pages(pages, scales))
    want = np.asarray(pages, np.float32) * np.asarray(scales).transpose(0, 2, 1)[..., None]
    np.testing.assert_array_equal(got, want)


def test_quantized_pages_without_scales_are_rejected():
    case = make_case(fresh_rng(), MIXED, num_q_heads=4, max_seqs=6, **SMALL)
    args, scales, _ = quantized_args(case, jnp.int8)
    with pytest.raises(ValueError, match="need k_scales"):
        ragged_paged_attention_reference(*args, sm_scale=case.sm_scale)
    with pytest.raises(ValueError, match="v_scales must be float32"):
        ragged_paged_attention_reference(*args, sm_scale=case.sm_scale, k_scales=scales["k_scales"],
                                         v_scales=scales["v_scales"][:, :, :2])
    with pytest.raises(ValueError, match="only for quantized pages"):
        ragged_paged_attention_reference(*case.args(), sm_scale=case.sm_scale, **scales)


def test_single_kv_head_8bit_pages_take_the_squeezed_tpu_path():
    """One 8-bit KV head: the TPU kernel takes the cache as [P, ps, D] (squeeze_kv_heads)."""
    case = make_case(fresh_rng(), MIXED, num_q_heads=4, num_kv_heads=1, head_dim=16, page_size=4, max_seqs=6)
    args, scales, plain = quantized_args(case, ml_dtypes.float8_e4m3fn)
    out = BACKENDS["tpu_interpret"](*args, sm_scale=case.sm_scale, **scales)
    want = ragged_paged_attention_reference(*plain, sm_scale=case.sm_scale)
    assert_close(out[:case.num_live_rows], np.asarray(want)[:case.num_live_rows], rtol=1e-5)
