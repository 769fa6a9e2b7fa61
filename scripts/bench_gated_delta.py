"""Gated DeltaNet (Qwen3-Next / Qwen3.5 linear attention) on this machine: the token recurrence
against the chunk-parallel form, and a ragged step of decode rows, for one layer at the published
shapes (16 key heads, 32 value heads, head dims 128, bf16 q/k/v, float32 states).

    python scripts/bench_gated_delta.py                      # T = 512, 2048; 64 decode rows
    python scripts/bench_gated_delta.py --tokens 512 --chunks 32,64

Each figure is the median of --repeats jitted runs after one warm-up (compile excluded). This is
the measurement a Pallas kernel has to beat (kernels_pallas/gated_delta_reference.py is the XLA
form and the oracle).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

HK, HV, DK, DV = 16, 32, 128, 128


def inputs(t: int, seed: int = 0):
    import jax
    import jax.numpy as jnp

    k1, k2, k3, k4, k5 = jax.random.split(jax.random.key(seed), 5)
    q = jax.random.normal(k1, (t, HK, DK), jnp.bfloat16)
    k = jax.random.normal(k2, (t, HK, DK), jnp.bfloat16)
    v = jax.random.normal(k3, (t, HV, DV), jnp.bfloat16)
    g = -jax.nn.softplus(jax.random.normal(k4, (t, HV), jnp.float32))  # log decay <= 0
    beta = jax.nn.sigmoid(jax.random.normal(k5, (t, HV), jnp.float32))
    return q, k, v, g, beta


def median_ms(fn, args, repeats: int) -> float:
    import jax

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="512,2048", help="prefill lengths, comma-separated")
    ap.add_argument("--chunks", default="64", help="chunk sizes of the chunked form, comma-separated")
    ap.add_argument("--decode-rows", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()

    import functools

    import jax
    import jax.numpy as jnp

    from kernels_pallas import gated_delta_reference as gd

    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               "unknown CPU")
    print(f"{cpu} | jax {jax.__version__} | {HK} key / {HV} value heads, Dk = Dv = {DK}")
    state = jnp.zeros((HV, DK, DV), jnp.float32)
    for t in [int(x) for x in args.tokens.split(",")]:
        q, k, v, g, beta = inputs(t)
        rec = jax.jit(gd.gated_delta_recurrent)
        print(f"T={t} recurrent: {median_ms(rec, (q, k, v, g, beta, state), args.repeats):.1f} ms")
        for c in [int(x) for x in args.chunks.split(",")]:
            chunked = jax.jit(functools.partial(gd.gated_delta_chunked, chunk=c))
            print(f"T={t} chunked (chunk {c}): {median_ms(chunked, (q, k, v, g, beta, state), args.repeats):.1f} ms")
    n = args.decode_rows
    q, k, v, g, beta = inputs(n, seed=1)
    states = jnp.zeros((n, HV, DK, DV), jnp.float32)
    starts, lens = jnp.arange(n, dtype=jnp.int32), jnp.ones(n, jnp.int32)
    ragged = jax.jit(gd.ragged_gated_delta)
    ms = median_ms(ragged, (q, k, v, g, beta, states, starts, lens), args.repeats)
    print(f"ragged, {n} decode rows: {ms:.1f} ms ({n * HV * DK * DV * 4 / 2**20:.0f} MiB of states read and written)")


if __name__ == "__main__":
    main()
