"""Attention sinks (gpt-oss: one learned, value-less logit per q head) and Gemma 2's logit soft cap
in every ragged paged attention backend: the reference against the formula written in numpy, every
other backend (kernels in interpret mode) against the reference, with plain and 8-bit pages."""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from rpa_cases import (
    MIXED,
    SMALL,
    assert_close,
    check_against_reference,
    fresh_rng,
    make_case,
    make_sinks,
    numpy_oracle,
    quantized_args,
    scramble_padding,
)

from jaxserve.model.attention import _shard_over_heads
from kernels_pallas import _gpu_or_reference, get_attention_backend, ragged_paged_attention
from kernels_pallas.kv_quant import is_quantized
from kernels_pallas.ragged_paged_attention_gpu import ragged_paged_attention_gpu
from kernels_pallas.ragged_paged_attention_reference import ragged_paged_attention_reference
from kernels_pallas.ragged_paged_attention_tpu import ragged_paged_attention_tpu

BACKENDS = {
    "tiled": get_attention_backend("tiled"),
    "cpu": get_attention_backend("cpu"),  # native decode kernel (int8 pages too; float8 takes the jnp decode)
    # several q blocks / tiles per sequence and several kv blocks per row, multi-page TPU scale rows
    "tpu_interpret": lambda *a, **kw: ragged_paged_attention_tpu(*a, interpret=True, block_q=4, pages_per_block=2,
                                                                 **kw),
    "gpu_interpret": lambda *a, **kw: ragged_paged_attention_gpu(*a, interpret=True, block_q=2, block_kv=4, **kw),
}
# group 4, and group 3 (padded to 4 rows per token in the GPU kernel; no power of two for the TPU's
# per-row sink select) with a window and a soft cap on large logits
FEATURES = {
    "g4": (4, dict()),
    "g3_window_softcap": (3, dict(sliding_window=5, soft_cap=2.0)),
}


def _case(rng, group, **kw):
    case = make_case(rng, MIXED, num_q_heads=2 * group, max_seqs=7, extra_rows=3, **SMALL, **kw)
    scramble_padding(case)
    case.q *= 4.0  # logits of several units: the soft cap bends them, and sinks compete with them
    return case


# --- the reference is the formula --------------------------------------------------------------

@pytest.mark.parametrize("kw", [dict(), dict(sliding_window=3, soft_cap=1.5, chunk_pages=1)],
                         ids=["one_chunk", "window_softcap_chunked"])
def test_reference_with_sinks_is_the_formula_in_numpy(kw):
    """out = sum_j exp(s_j - m) v_j / (sum_j exp(s_j - m) + exp(sink_h - m)), m = max(s, sink_h), in
    float64 per row and head (rpa_cases.numpy_oracle), on sinks far above, near and far below the
    logits."""
    rng = fresh_rng()
    case = _case(rng, 4)
    sinks = make_sinks(rng, 8)
    out = ragged_paged_attention_reference(*case.args(), sm_scale=case.sm_scale, sinks=jnp.asarray(sinks), **kw)
    oracle_kw = {k: v for k, v in kw.items() if k != "chunk_pages"}
    live = case.num_live_rows
    assert_close(np.asarray(out)[:live], numpy_oracle(case, sinks=sinks, **oracle_kw), rtol=1e-5)
    assert np.all(np.asarray(out)[live:] == 0.0)


def test_sinks_and_soft_cap_change_the_output():
    """Not vacuous: a sink takes probability mass from every key (the output shrinks towards 0 as
    the sink rises, and is the sink-less one as it falls), and the soft cap moves the output of
    large logits."""
    rng = fresh_rng()
    case = _case(rng, 4)
    args, live = case.args(), case.num_live_rows

    def run(**kw):
        return np.asarray(ragged_paged_attention_reference(*args, sm_scale=case.sm_scale, **kw))[:live]

    plain = run()
    with_sinks = run(sinks=jnp.asarray(make_sinks(rng, 8)))
    assert np.abs(with_sinks - plain).max() > 0.1 * np.abs(plain).max()
    # one head's sink only changes that head
    one = np.zeros(8, np.float32)
    one[5] = 3.0
    diff = np.abs(run(sinks=jnp.asarray(one - 1e4 * (np.arange(8) != 5))) - plain).max(axis=(0, 2))
    assert diff[5] > 1e-2 and np.all(diff[np.arange(8) != 5] == 0.0), diff
    np.testing.assert_allclose(run(sinks=jnp.full((8,), -1e4, jnp.float32)), plain, rtol=1e-6, atol=1e-7)
    high = run(sinks=jnp.full((8,), 1e4, jnp.float32))
    assert np.abs(high).max() < 1e-30  # exp(s - 1e4) underflows: the sink holds all the mass
    capped = run(soft_cap=2.0)
    assert np.abs(capped - plain).max() > 0.1 * np.abs(plain).max()
    assert_close(capped, numpy_oracle(case, soft_cap=2.0), rtol=1e-5)


# --- every backend equals the reference ---------------------------------------------------------

@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_backend_with_sinks_matches_reference(backend, feature):
    group, kw = FEATURES[feature]
    rng = fresh_rng()
    case = _case(rng, group, poison=True)
    check_against_reference(BACKENDS[backend], case, sinks=jnp.asarray(make_sinks(rng, 2 * group)), **kw)


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_backend_soft_cap_alone_matches_reference(backend):
    """Soft cap without sinks (Gemma 2), in f32 and bf16: every backend caps before masking, after
    the scale, as the reference does."""
    rng = fresh_rng()
    case = _case(rng, 4)
    check_against_reference(BACKENDS[backend], case, soft_cap=2.0)
    check_against_reference(BACKENDS[backend], case, dtype=jnp.bfloat16, rtol=2e-2, soft_cap=2.0)


@pytest.mark.parametrize("page_dtype", [jnp.int8, ml_dtypes.float8_e4m3fn], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_backend_on_quantized_pages_with_sinks_window_and_soft_cap(backend, page_dtype):
    """8-bit pages: the kernels scale their logits by the K scales before the cap, and the sinks
    join the softmax the scaled logits feed; equal to the reference on the dequantized pages."""
    rng = fresh_rng()
    case = _case(rng, 4)
    args, scales, plain = quantized_args(case, page_dtype)
    assert is_quantized(args[1].dtype)
    kw = dict(sm_scale=case.sm_scale, sliding_window=5, soft_cap=2.0, sinks=jnp.asarray(make_sinks(rng, 8)))
    out = np.asarray(BACKENDS[backend](*args, **scales, **kw))
    want = np.asarray(ragged_paged_attention_reference(*plain, **kw))
    live = case.num_live_rows
    assert_close(out[:live], want[:live], rtol=1e-5, what=backend)
    assert np.all(out[live:] == 0.0)


def test_bf16_sinks_through_the_dispatch_and_the_gpu_fallback():
    """`ragged_paged_attention` (the CPU backend here) and the GPU dispatch's reference fallback
    (head_dim 24: no Triton kernel) pass the sinks on."""
    rng = fresh_rng()
    case = _case(rng, 4)
    sinks = jnp.asarray(make_sinks(rng, 8))
    check_against_reference(ragged_paged_attention, case, dtype=jnp.bfloat16, rtol=2e-2, sinks=sinks,
                            sliding_window=5)
    odd = make_case(rng, MIXED, num_q_heads=4, num_kv_heads=2, head_dim=24, page_size=4)
    sinks = jnp.asarray(make_sinks(rng, 4))
    want = numpy_oracle(odd, sinks=np.asarray(sinks))
    assert_close(_gpu_or_reference(*odd.args(), sm_scale=odd.sm_scale, sinks=sinks), want, rtol=1e-5)


@pytest.mark.parametrize("fn", [ragged_paged_attention_reference, BACKENDS["tiled"], ragged_paged_attention_tpu,
                                ragged_paged_attention_gpu], ids=["reference", "tiled", "tpu_kernel", "gpu_kernel"])
def test_wrappers_reject_bad_sinks(fn):
    case = _case(fresh_rng(), 4)
    for bad in (jnp.zeros((4,), jnp.float32), jnp.zeros((8,), jnp.bfloat16), jnp.zeros((1, 8), jnp.float32)):
        with pytest.raises(ValueError, match=r"sinks must be None or float32 \[num_q_heads\] = \(8,\)"):
            fn(*case.args(), sm_scale=case.sm_scale, sinks=bad)


# --- tensor parallel: sinks split over the q heads like q ---------------------------------------

def test_shard_over_heads_splits_sinks_like_the_q_heads():
    """The shard_map wrapper of jaxserve/model/attention.py over a 4-way model axis (8 q heads over
    4 KV heads: 2 q heads and their 2 sinks per device), int8 pages with their scales beside the
    sinks: equal to the reference on the whole arrays."""
    mesh = Mesh(np.array(jax.devices()[:4]), ("model",))
    rng = fresh_rng()
    case = make_case(rng, MIXED, num_q_heads=8, num_kv_heads=4, head_dim=16, page_size=4, max_seqs=6, extra_rows=2)
    case.q *= 4.0
    args, scales, plain = quantized_args(case, jnp.int8)
    sinks = jnp.asarray(make_sinks(rng, 8))
    fn = _shard_over_heads(get_attention_backend("cpu"), mesh, "model")
    put = lambda x, *spec: jax.device_put(x, NamedSharding(mesh, P(*spec)))  # noqa: E731
    q, k, v = put(args[0], None, "model", None), put(args[1], None, None, "model", None), \
        put(args[2], None, None, "model", None)
    ks, vs = (put(s, None, "model", None) for s in (scales["k_scales"], scales["v_scales"]))
    kw = dict(sm_scale=case.sm_scale, sliding_window=5, soft_cap=2.0)
    out = jax.jit(lambda q, k, v, ks, vs, sk: fn(q, k, v, *args[3:], k_scales=ks, v_scales=vs, sinks=sk, **kw))(
        q, k, v, ks, vs, put(sinks, "model"))
    assert out.sharding.spec == P(None, "model", None)
    want = ragged_paged_attention_reference(*plain, sinks=sinks, **kw)
    live = case.num_live_rows
    assert_close(np.asarray(out)[:live], np.asarray(want)[:live], rtol=1e-5)
