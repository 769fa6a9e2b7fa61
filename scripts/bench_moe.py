"""A mixture-of-experts model against a dense one of the same active parameters: decode step time
per batch size, and the share of the MoE block that is routing and dispatch.

    python scripts/bench_moe.py --batches 1,8,32

bench-105m (dense, MLP width 1536) and bench-105m-moe (every MLP 8 experts of width 768, top-2: each
token passes through the same 1536 columns) on random weights, through the engine at the planner's
decode shapes (scripts/bench_engine.py's run_batch: B sequences of --context tokens, steady decode,
median of --repeats). Then one MoE layer's block alone at the decode shape [B, 512]: the whole
block, and the block with its three grouped matmuls replaced by a copy (routing, the sort by
expert, the gather and the scatter back: what dispatch costs), each jitted and timed to completion.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_common import cpu_model  # noqa: E402
from bench_engine import preset_model, run_batch  # noqa: E402


def block_times(cfg, weights, batch: int, repeats: int) -> dict[str, float]:
    """Milliseconds of one MoE block at [batch, D]: whole, and with the expert matmuls as copies."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import roofline as rl
    from jaxserve.model import moe

    layer = weights.layers[0]
    x = jnp.asarray(np.random.default_rng(0).standard_normal((batch, cfg.hidden_size), dtype=np.float32))
    whole = jax.jit(lambda lw, h: moe.moe_mlp(lw, h, cfg.moe))
    real = moe.grouped_matmul
    moe.grouped_matmul = lambda lhs, rhs, sizes: lhs[:, :1] * jnp.ones((1, rhs.shape[-1]), lhs.dtype)
    try:
        dispatch = jax.jit(lambda lw, h: moe.moe_mlp(lw, h, cfg.moe))
        jax.block_until_ready(dispatch(layer, x))
    finally:
        moe.grouped_matmul = real
    out = {"block_ms": rl.median_time(lambda: jax.block_until_ready(whole(layer, x)), repeats) * 1e3,
           "dispatch_ms": rl.median_time(lambda: jax.block_until_ready(dispatch(layer, x)), repeats) * 1e3}
    out["dispatch_share"] = out["dispatch_ms"] / out["block_ms"]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args(argv)

    models = {name: preset_model(name) for name in ("bench-105m", "bench-105m-moe")}
    rows = []
    for b in [int(x) for x in args.batches.split(",")]:
        row = {"batch": b}
        for name, (cfg, weights) in models.items():
            r = run_batch(cfg, weights, b, args.context, args.steps, args.repeats)
            row[f"{name}_step_ms"] = r["step_ms"]
            row[f"{name}_recompiles"] = r["recompiles"]
        row["moe_over_dense"] = row["bench-105m-moe_step_ms"] / row["bench-105m_step_ms"]
        cfg, weights = models["bench-105m-moe"]
        row.update(block_times(cfg, weights, b, args.repeats * 4))
        # share of the MoE step spent routing and dispatching (every one of the 8 layers is sparse)
        row["dispatch_step_share"] = cfg.num_layers * row["dispatch_ms"] / row["bench-105m-moe_step_ms"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"\nCPU: {cpu_model()}; context {args.context}; median of {args.repeats}")
    print("| batch | dense step ms | MoE step ms | MoE / dense | MoE block ms | of which routing + dispatch ms | "
          "dispatch share of the block | dispatch share of the step |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['bench-105m_step_ms']:.2f} | {r['bench-105m-moe_step_ms']:.2f} | "
              f"{r['moe_over_dense']:.2f}x | {r['block_ms']:.3f} | {r['dispatch_ms']:.3f} | "
              f"{100 * r['dispatch_share']:.0f}% | {100 * r['dispatch_step_share']:.0f}% |")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
