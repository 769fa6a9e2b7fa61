"""Ragged paged attention on the local accelerator: kernel vs reference time, correctness, and
achieved HBM bandwidth against the device's measured copy bandwidth.

    python scripts/kernel_bench.py                  # default cases, bf16 and f32
    python scripts/kernel_bench.py --quick          # one small case (smoke run)
    python scripts/kernel_bench.py --backend cpu --baseline tiled --dtypes float32 --repeats 7
                                                    # CPU: native decode kernel vs the jnp path
    python scripts/kernel_bench.py --q-heads 16 --kv-heads 1 --head-dim 576 --latent 512
                                                    # DeepSeek-V3's latent rows (TP=8): values read
                                                    # from the key rows vs the same pages as K and V

Prints one table row per (case, dtype); exits 1 if any kernel output differs from the reference
beyond tolerance (|err| <= rtol * (max|ref| + |ref|); rtol 1e-5 for f32, 1e-2 for bf16).
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from kernels_pallas import BACKENDS, get_attention_backend  # noqa: E402

RTOL = {"float32": 1e-5, "bfloat16": 1e-2}


@dataclasses.dataclass(frozen=True)
class BenchCase:
    name: str
    q_lens: tuple[int, ...]
    ctx_lens: tuple[int, ...]  # seq_lens: total tokens after this step


def default_cases(rng: np.random.Generator, num_seqs: int, max_ctx: int) -> list[BenchCase]:
    """Decode (random / full contexts), a mixed step (decodes + prefill chunks), pure prefill."""
    ctx = [int(c) for c in rng.integers(1, max_ctx + 1, num_seqs)]
    n_long = max(1, num_seqs // 8)
    chunk = min(256, max_ctx)
    mixed_q = [1] * (num_seqs - n_long) + [chunk] * n_long
    mixed_ctx = [max(c, q) for c, q in zip(ctx, mixed_q)]
    prefill = min(512, max_ctx)
    prefill_ctx = [int(c) for c in rng.integers(prefill, max_ctx + 1, n_long)]
    return [
        BenchCase("decode_rand", (1,) * num_seqs, tuple(ctx)),
        BenchCase("decode_full", (1,) * num_seqs, (max_ctx,) * num_seqs),
        BenchCase("mixed", tuple(mixed_q), tuple(mixed_ctx)),
        BenchCase(f"prefill_{prefill}", (prefill,) * n_long, tuple(prefill_ctx)),
    ]


def make_inputs(case: BenchCase, *, num_q_heads: int, num_kv_heads: int, head_dim: int,
                page_size: int, dtype, seed: int):
    rng = np.random.default_rng(seed)
    pages = [-(-c // page_size) for c in case.ctx_lens]
    num_pages = sum(pages) + 1
    max_pages = max(pages)
    perm = rng.permutation(num_pages).astype(np.int32)
    tables = np.zeros((len(pages), max_pages), np.int32)
    at = 0
    for s, n in enumerate(pages):
        tables[s, :n] = perm[at:at + n]
        at += n
    cu = np.concatenate([[0], np.cumsum(case.q_lens)]).astype(np.int32)
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    shape = (num_pages, page_size, num_kv_heads, head_dim)
    args = (
        jax.random.normal(kq, (int(cu[-1]), num_q_heads, head_dim), dtype),
        jax.random.normal(kk, shape, dtype),
        jax.random.normal(kv, shape, dtype),
        jnp.asarray(case.ctx_lens, jnp.int32),
        jnp.asarray(cu),
        jnp.asarray(tables),
        jnp.array([len(pages)], jnp.int32),
    )
    return args


def bytes_moved(case: BenchCase, *, num_q_heads: int, num_kv_heads: int, head_dim: int,
                itemsize: int, latent: int | None = None) -> int:
    """Minimum HBM traffic: every live K/V token once (a latent row once: its values are its lanes),
    q in, out back."""
    kv = sum(case.ctx_lens) * num_kv_heads * head_dim * itemsize * (1 if latent else 2)
    qo = sum(case.q_lens) * num_q_heads * (head_dim + (latent or head_dim)) * itemsize
    return kv + qo


def attention_flops(case: BenchCase, *, num_q_heads: int, head_dim: int) -> int:
    """Causal QK^T and PV multiply-adds, counted as 2 flops each."""
    keys = sum(sum(c - q + i + 1 for i in range(q)) for q, c in zip(case.q_lens, case.ctx_lens))
    return 4 * keys * num_q_heads * head_dim


def time_call(fn, args, iters: int) -> float:
    """Seconds per call: warm-up (compile), then `iters` calls back to back."""
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    out = None
    for _ in range(iters):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / iters


def copy_bandwidth(num_bytes: int = 1 << 30, iters: int = 10) -> float:
    """Bytes/s of an elementwise read+write over a large buffer (the device's practical peak)."""
    x = jnp.ones((num_bytes // 2,), jnp.bfloat16)
    fn = jax.jit(lambda a: a * 2)
    return 2 * num_bytes / time_call(fn, (x,), iters)


def compare(out, ref, rtol: float) -> tuple[bool, float]:
    """(every value within rtol * (max|ref| + |ref|) and finite, max error / max|ref|)."""
    out = np.asarray(out.astype(jnp.float32), np.float64)
    ref = np.asarray(ref.astype(jnp.float32), np.float64)
    scale = float(np.max(np.abs(ref)))
    err = np.abs(out - ref)
    ok = bool(np.all(np.isfinite(out)) and np.all(err <= rtol * (scale + np.abs(ref))))
    return ok, float(err.max()) / scale


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--backend", default="auto", choices=BACKENDS)
    p.add_argument("--baseline", default="reference", choices=BACKENDS,
                   help="what the kernel is timed and checked against (the 'ref ms' column)")
    p.add_argument("--repeats", type=int, default=1,
                   help="timings of kernel and baseline, alternated; the medians are reported")
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--num-seqs", type=int, default=32)
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-context", type=int, default=4096)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="one small decode case")
    p.add_argument("--interpret", action="store_true",
                   help="run the gpu/tpu kernel in the Pallas interpreter (script smoke test on CPU)")
    p.add_argument("--copy-mib", type=int, default=1024, help="buffer size for the copy bandwidth")
    p.add_argument("--latent", type=int, default=None, metavar="L",
                   help="values read from the key rows' first L lanes (v_pages=None, multi-head latent "
                        "attention); the baseline gets the same pages as K and V and keeps L lanes")
    a = p.parse_args(argv)

    kernel = get_attention_backend(a.backend)
    kernel_kw = {"interpret": True} if a.interpret and a.backend in ("gpu", "tpu") else {}
    reference = get_attention_backend(a.baseline)
    dims = dict(num_q_heads=a.q_heads, num_kv_heads=a.kv_heads, head_dim=a.head_dim)
    rng = np.random.default_rng(a.seed)
    cases = default_cases(rng, a.num_seqs, a.max_context)
    if a.quick:
        cases = [BenchCase("quick_decode", (1,) * 4, (1, 17, 100, 300))]

    print(f"kernel: {a.backend}{' (interpreted)' if kernel_kw else ''} vs {a.baseline}; "
          f"heads {a.q_heads}/{a.kv_heads}, head_dim {a.head_dim}, page_size {a.page_size}"
          + (f", values the key rows' first {a.latent} lanes" if a.latent else ""))
    print(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}), jax {jax.__version__}")
    copy_bw = copy_bandwidth(a.copy_mib << 20)
    print(f"measured copy bandwidth (read+write of {a.copy_mib} MiB bf16): {copy_bw / 1e9:.0f} GB/s")
    header = (f"{'case':<13}{'dtype':<10}{'T':>6}{'kernel ms':>11}{'ref ms':>9}{'speedup':>9}"
              f"{'MB':>9}{'GB/s':>8}{'%copy':>7}{'TFLOP/s':>9}{'rel err':>10}  ok")
    print(header)
    print("-" * len(header))
    failed = False
    for dtype_name in a.dtypes.split(","):
        dtype = jnp.dtype(dtype_name)
        for case in cases:
            args = make_inputs(case, page_size=a.page_size, dtype=dtype, seed=a.seed, **dims)
            scale = a.head_dim ** -0.5
            if a.latent:  # one page stream: the kernel reads K's rows as values, the baseline reads them twice
                run_kernel = jax.jit(lambda q, k, _, *x: kernel(q, k, None, *x, sm_scale=scale, v_head_dim=a.latent,
                                                                **kernel_kw))
                run_ref = jax.jit(lambda q, k, _, *x: reference(q, k, k, *x, sm_scale=scale)[..., :a.latent])
            else:
                run_kernel = jax.jit(lambda *x: kernel(*x, sm_scale=scale, **kernel_kw))
                run_ref = jax.jit(lambda *x: reference(*x, sm_scale=scale))
            ref_iters = a.iters if a.baseline != "reference" else max(1, a.iters // 4)
            pairs = [(time_call(run_kernel, args, a.iters), time_call(run_ref, args, ref_iters))
                     for _ in range(a.repeats)]
            t_kernel, t_ref = (float(np.median(t)) for t in zip(*pairs))
            ok, err = compare(run_kernel(*args), run_ref(*args), RTOL[dtype_name])
            failed |= not ok
            nbytes = bytes_moved(case, itemsize=dtype.itemsize, latent=a.latent, **dims)
            flops = attention_flops(case, num_q_heads=a.q_heads, head_dim=a.head_dim)
            bw = nbytes / t_kernel
            print(f"{case.name:<13}{dtype_name:<10}{sum(case.q_lens):>6}{t_kernel * 1e3:>11.3f}"
                  f"{t_ref * 1e3:>9.3f}{t_ref / t_kernel:>9.2f}{nbytes / 1e6:>9.1f}"
                  f"{bw / 1e9:>8.0f}{100 * bw / copy_bw:>7.1f}{flops / t_kernel / 1e12:>9.2f}"
                  f"{err:>10.2e}  {'yes' if ok else 'NO'}", flush=True)
    print(f"all kernel outputs match the {a.baseline}" if not failed else f"MISMATCH against the {a.baseline}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
