"""The CPU backend (tiled prefill, native decode kernel through jax.ffi) == the reference."""
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from rpa_cases import (
    MIXED,
    SMALL,
    check_against_reference,
    fresh_rng,
    fresh_seed,
    make_case,
    scramble_padding,
)

from kernels_pallas import attention_for_platform, cpu_decode_attention, get_attention_backend
from kernels_pallas.cpu_decode_attention import ragged_paged_attention_cpu
from kernels_pallas.ragged_paged_attention_tiled import ragged_paged_attention_tiled



def _check(case, **kw):
    return check_against_reference(ragged_paged_attention_cpu, case, **kw)


def test_the_native_kernel_builds_here_and_serves_the_cpu_platform():
    # CI and every supported install have a C++ compiler: the kernel must build, not fall back
    assert cpu_decode_attention.available()
    assert attention_for_platform("cpu") is ragged_paged_attention_cpu
    assert get_attention_backend("cpu") is ragged_paged_attention_cpu
    step = jax.jit(lambda *a: ragged_paged_attention_cpu(*a, sm_scale=0.25))
    case = make_case(fresh_rng(), MIXED, num_q_heads=4, **SMALL)
    assert cpu_decode_attention.TARGET in step.lower(*case.args()).as_text()


@pytest.mark.parametrize("group", [1, 2, 4])
def test_mixed_decodes_and_chunks_match_the_reference(group):
    case = make_case(fresh_rng(), MIXED, num_q_heads=2 * group, max_seqs=len(MIXED) + 2, extra_rows=3, **SMALL)
    scramble_padding(case)
    _check(case)


def test_window_soft_cap_and_bf16_pages():
    case = make_case(fresh_rng(), [(1, 23), (1, 9), (4, 14), (1, 1)], num_q_heads=8, max_seqs=6, **SMALL)
    case.q *= 4.0
    _check(case, sliding_window=6, soft_cap=2.0)
    _check(case, dtype=jnp.bfloat16, rtol=1e-2, soft_cap=2.0)


@pytest.mark.parametrize("head_dim,page_size", [(42, 32), (6, 16), (16, 12)])
def test_head_and_page_sizes_off_the_vector_width(head_dim, page_size):
    """The kernel reads head values and page slots a vector (8 floats with AVX, else 4) at a time:
    a head with a remainder (42), one shorter than a vector (6), pages of 32 and of 12 slots (the
    rest of the last vector masked), window and soft cap included."""
    case = make_case(fresh_rng(), [(1, 70), (1, 33), (1, 1), (3, 40), (1, 17)], num_q_heads=6, num_kv_heads=2,
                     head_dim=head_dim, page_size=page_size, max_seqs=7)
    scramble_padding(case)
    _check(case)
    _check(case, sliding_window=20, soft_cap=3.0)
    _check(case, dtype=jnp.bfloat16, rtol=1e-2)


def test_same_numbers_as_the_tiled_jnp_path_at_model_shapes():
    """bench-105m's attention shape (8 q heads over 4 KV heads of 64, 16-token pages): decodes of
    up to 700 tokens agree with the jnp decode to float32 rounding."""
    seed = fresh_seed()
    case = make_case(np.random.default_rng(seed), [(1, int(n)) for n in np.random.default_rng(seed).integers(1, 700, 40)],
                     num_q_heads=8, num_kv_heads=4, head_dim=64, page_size=16)
    args = case.args()
    got = np.asarray(ragged_paged_attention_cpu(*args, sm_scale=case.sm_scale))
    want = np.asarray(ragged_paged_attention_tiled(*args, sm_scale=case.sm_scale))
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)


def test_without_a_compiler_the_cpu_platform_runs_the_tiled_path(monkeypatch, caplog):
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    monkeypatch.setattr(cpu_decode_attention, "_cache_dir", lambda: cpu_decode_attention.Path("/nonexistent"))
    cpu_decode_attention.available.cache_clear()
    try:
        assert not cpu_decode_attention.available()
        assert attention_for_platform("cpu") is ragged_paged_attention_tiled
        with pytest.raises(ValueError, match="'cpu' needs its native decode kernel"):
            get_attention_backend("cpu")
        assert "no C++ compiler" in caplog.text
    finally:
        cpu_decode_attention.available.cache_clear()
    monkeypatch.undo()
    assert cpu_decode_attention.available()


def test_a_compile_error_is_reported_not_raised(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(cpu_decode_attention, "_FLAGS", [*cpu_decode_attention._FLAGS, "-include/nonexistent/broken.h"])
    monkeypatch.setattr(cpu_decode_attention, "_cache_dir", lambda: tmp_path)
    cpu_decode_attention.available.cache_clear()
    try:
        assert not cpu_decode_attention.available()
        assert "did not build or load" in caplog.text
        assert list(tmp_path.iterdir()) == []  # no half-written library left behind
    finally:
        cpu_decode_attention.available.cache_clear()


def test_prepare_builds_the_library_on_a_thread_before_any_trace(tmp_path, monkeypatch):
    """The loader's head start on a cold machine: prepare() returns at once and its thread leaves the
    library where available() looks, so the first trace finds it built."""
    import threading

    monkeypatch.setattr(cpu_decode_attention, "_cache_dir", lambda: tmp_path)
    started = time.monotonic()
    cpu_decode_attention.prepare()
    assert time.monotonic() - started < 0.5  # the compile runs on its thread, not in the caller
    builders = [t for t in threading.enumerate() if t.name == "jaxserve-native-kernel"]
    assert builders
    for thread in builders:
        thread.join(300)
    (library,) = tmp_path.glob("cpu_decode_attention-*.so")
    assert cpu_decode_attention.build(cpu_decode_attention._compiler(), tmp_path) == library  # found, not rebuilt
