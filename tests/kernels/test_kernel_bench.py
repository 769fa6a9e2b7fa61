"""The bookkeeping in scripts/kernel_bench.py (bytes, flops, the pass/fail comparison)."""
import importlib.util
import sys
from pathlib import Path

import jax.numpy as jnp
from rpa_cases import fresh_rng

_PATH = Path(__file__).resolve().parents[2] / "scripts" / "kernel_bench.py"
_spec = importlib.util.spec_from_file_location("kernel_bench", _PATH)
kernel_bench = importlib.util.module_from_spec(_spec)
sys.modules["kernel_bench"] = kernel_bench  # dataclasses look the module up
_spec.loader.exec_module(kernel_bench)


def test_bytes_and_flops_count_live_tokens_and_causal_keys():
    # seq 0: decode at position 9 (10 keys); seq 1: 3 new rows at positions 2..4 (3+4+5 keys).
    case = kernel_bench.BenchCase("t", q_lens=(1, 3), ctx_lens=(10, 5))
    nbytes = kernel_bench.bytes_moved(case, num_q_heads=4, num_kv_heads=2, head_dim=8, itemsize=2)
    assert nbytes == (10 + 5) * 2 * 8 * 2 * 2 + (1 + 3) * 4 * 8 * 2 * 2
    flops = kernel_bench.attention_flops(case, num_q_heads=4, head_dim=8)
    assert flops == 4 * (10 + 3 + 4 + 5) * 4 * 8


def test_compare_flags_errors_beyond_tolerance_and_nan():
    ref = jnp.array([1.0, -2.0, 0.5])
    ok, err = kernel_bench.compare(ref + 1e-6, ref, 1e-5)
    assert ok and err < 1e-5
    ok, _ = kernel_bench.compare(ref.at[2].add(1e-3), ref, 1e-5)
    assert not ok
    ok, _ = kernel_bench.compare(ref.at[0].set(jnp.nan), ref, 1e-5)
    assert not ok


def test_default_cases_have_valid_lengths():
    cases = kernel_bench.default_cases(fresh_rng(), num_seqs=32, max_ctx=4096)
    for case in cases:
        assert len(case.q_lens) == len(case.ctx_lens)
        assert all(1 <= q <= c <= 4096 for q, c in zip(case.q_lens, case.ctx_lens))


def test_cpu_kernel_against_the_tiled_baseline_runs_and_matches(capsys):
    argv = ["--quick", "--backend", "cpu", "--baseline", "tiled", "--dtypes", "float32", "--iters", "1",
            "--repeats", "2", "--copy-mib", "1"]
    assert kernel_bench.main(argv) == 0
    out = capsys.readouterr().out
    assert "kernel: cpu vs tiled" in out and "all kernel outputs match the tiled" in out


def test_latent_rows_are_counted_once_and_the_latent_run_matches(capsys):
    """--latent L: a latent row's bytes once (its values are its own lanes), out in L lanes; the tiled
    path reading the rows as values matches the reference given the same pages as K and V."""
    case = kernel_bench.BenchCase("t", q_lens=(1, 3), ctx_lens=(10, 5))
    nbytes = kernel_bench.bytes_moved(case, num_q_heads=4, num_kv_heads=1, head_dim=48, itemsize=2, latent=32)
    assert nbytes == (10 + 5) * 1 * 48 * 2 + (1 + 3) * 4 * (48 + 32) * 2
    argv = ["--quick", "--backend", "tiled", "--dtypes", "float32", "--iters", "1", "--copy-mib", "1",
            "--q-heads", "8", "--kv-heads", "1", "--head-dim", "48", "--latent", "32"]
    assert kernel_bench.main(argv) == 0
    out = capsys.readouterr().out
    assert "values the key rows' first 32 lanes" in out and "all kernel outputs match the reference" in out
