"""Backend choice, argument checks (ValueError naming the argument), and that both kernels pass
their backend's lowering (Triton for CUDA, Mosaic for TPU) at serving sizes, on this CPU."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from rpa_cases import MIXED, SMALL, fresh_rng, make_case

import kernels_pallas
from kernels_pallas import (
    get_attention_backend,
    ragged_paged_attention,
    ragged_paged_attention_cpu,
    ragged_paged_attention_gpu,
    ragged_paged_attention_reference,
    ragged_paged_attention_tiled,
    ragged_paged_attention_tpu,
)

ALL = [ragged_paged_attention_reference, ragged_paged_attention_tpu, ragged_paged_attention_gpu]


def _case():
    return make_case(fresh_rng(), MIXED, num_q_heads=8, max_seqs=7, extra_rows=3,
                     **SMALL)


def test_auto_on_cpu_is_the_cpu_backend():
    """On CPU the default is the tiled path with the native decode kernel (it builds wherever a C++
    compiler is, CI included): the same numbers as the reference and as the jnp-only tiled path."""
    assert jax.default_backend() == "cpu"
    case = _case()
    args = case.args()
    got = ragged_paged_attention(*args, sm_scale=case.sm_scale)
    np.testing.assert_array_equal(np.asarray(got),
                                  np.asarray(ragged_paged_attention_cpu(*args, sm_scale=case.sm_scale)))
    want = ragged_paged_attention_reference(*args, sm_scale=case.sm_scale)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    tiled = ragged_paged_attention_tiled(*args, sm_scale=case.sm_scale)
    np.testing.assert_allclose(np.asarray(got), np.asarray(tiled), rtol=1e-5, atol=1e-6)
    assert get_attention_backend("auto") is ragged_paged_attention


def test_get_attention_backend_names():
    assert get_attention_backend("reference") is ragged_paged_attention_reference
    assert get_attention_backend("tpu") is ragged_paged_attention_tpu
    assert get_attention_backend("gpu") is ragged_paged_attention_gpu
    assert get_attention_backend("tiled") is ragged_paged_attention_tiled
    assert get_attention_backend("cpu") is ragged_paged_attention_cpu
    assert kernels_pallas.BACKENDS == ("reference", "tiled", "cpu", "tpu", "gpu", "auto")
    with pytest.raises(ValueError, match="unknown attention backend 'cuda'"):
        get_attention_backend("cuda")


def _bad(case, name):
    """The case's arguments with one of them broken; returns (args, kwargs, expected message)."""
    q, k, v, seq_lens, cu, tables, num_seqs = case.args()
    kw = dict(sm_scale=case.sm_scale)
    if name == "q_rank":
        q, match = q[0], "q must be"
    elif name == "v_shape":
        v, match = v[:-1], "v_pages shape"
    elif name == "kv_dtype":
        k, match = k.astype(jnp.bfloat16), "k_pages dtype"
    elif name == "heads":
        q, match = q[:, :3], "num_q_heads=3"
    elif name == "head_dim":
        q, match = q[..., :8], "head_dim"
    elif name == "seq_lens_dtype":
        seq_lens, match = seq_lens.astype(jnp.float32), "seq_lens must be int32"
    elif name == "cu_q_lens_shape":
        cu, match = cu[:-1], "cu_q_lens must have shape"
    elif name == "page_tables_rank":
        tables, match = tables[0], "page_tables must be"
    elif name == "num_seqs_shape":
        num_seqs, match = jnp.array([1, 2], jnp.int32), "num_seqs must have shape"
    elif name == "sliding_window":
        kw["sliding_window"], match = 0, "sliding_window"
    elif name == "soft_cap":
        kw["soft_cap"], match = -1.0, "soft_cap"
    else:
        raise AssertionError(name)
    return (q, k, v, seq_lens, cu, tables, num_seqs), kw, match


BAD = ["q_rank", "v_shape", "kv_dtype", "heads", "head_dim", "seq_lens_dtype", "cu_q_lens_shape",
       "page_tables_rank", "num_seqs_shape", "sliding_window", "soft_cap"]


@pytest.mark.parametrize("name", BAD)
@pytest.mark.parametrize("fn", ALL, ids=["reference", "tpu", "gpu"])
def test_wrappers_reject_bad_arguments(fn, name):
    args, kw, match = _bad(_case(), name)
    with pytest.raises(ValueError, match=match):
        fn(*args, interpret=True, **kw) if fn is not ragged_paged_attention_reference else fn(
            *args, **kw)


def test_gpu_wrapper_rejects_unsupported_sizes():
    case = make_case(fresh_rng(), MIXED, num_q_heads=4, num_kv_heads=2, head_dim=24,
                     page_size=4)
    with pytest.raises(ValueError, match="head_dim=24"):
        ragged_paged_attention_gpu(*case.args(), sm_scale=1.0)
    case = _case()
    with pytest.raises(ValueError, match="block_q must be a power of two"):
        ragged_paged_attention_gpu(*case.args(), sm_scale=1.0, block_q=3, interpret=True)
    with pytest.raises(ValueError, match="pages_per_block"):
        ragged_paged_attention_tpu(*case.args(), sm_scale=1.0, pages_per_block=0, interpret=True)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_kernel_lowers_for_its_backend_at_serving_sizes(platform, dtype):
    """Traces the non-interpreted kernel through Pallas' Triton / Mosaic lowering (no device)."""
    rng = fresh_rng()
    case = make_case(rng, [(1, 300), (1, 17), (70, 140), (5, 1024)], num_q_heads=32,
                     num_kv_heads=8, head_dim=128, page_size=16, max_seqs=8, extra_rows=9)
    fn = ragged_paged_attention_gpu if platform == "cuda" else ragged_paged_attention_tpu
    lowered = jax.jit(
        lambda *a: fn(*a, sm_scale=case.sm_scale, sliding_window=256, soft_cap=50.0)
    ).trace(*case.args(dtype)).lower(lowering_platforms=(platform,))
    text = lowered.as_text()
    marker = "__gpu$xla.gpu.triton" if platform == "cuda" else "tpu_custom_call"
    assert marker in text
