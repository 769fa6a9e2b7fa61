"""Weight quantization: quality against the unquantized model, decode speed on this CPU, and the
planner's estimate for accelerators.

    python scripts/bench_quant.py [--schemes int8,int4,fp8] [--speed-preset bench-105m] [--batches 1,64]

1. Quality, on every parity family (tests/hf_models.py: tiny random models written by transformers):
   mean KL(f32 || quantized) of the next-token distributions and top-1 agreement over a fixed
   128-token text, and greedy-token agreement over 256 generated tokens (the share of positions
   where the two greedy continuations agree, and the first position where they differ).
2. Speed on this CPU: one decode step (forward + sampler) at each batch, float32 against each
   scheme, on a random model of `--speed-preset` (bench_engine.run_batch with its breakdown), so the
   projections' share (layers) is visible apart from lm_head and attention.
3. Bytes per weight (all leaves, scales included) and the planner's decode estimate (roofline, no
   compile) for a Qwen3-8B-shaped model on TPU v6e and an H200, bf16 against each scheme.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import platform
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "tests"))

QWEN3_8B = dict(architectures=["Qwen3ForCausalLM"], vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                max_position_embeddings=40960, tie_word_embeddings=False, dtype="bfloat16")


def quality(schemes: list[str], text_len: int = 128, gen_len: int = 256) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from checkpoints import load_model
    from hf_models import VARIANTS, make_hf_model
    from jaxserve.model.dense import forward_dense, greedy_generate
    from jaxserve.sharding import make_mesh

    rows = []
    for variant in sorted(VARIANTS):
        with tempfile.TemporaryDirectory() as d:
            path, _ = make_hf_model(variant, Path(d), max_position_embeddings=512)
            cfg, weights = load_model(path, make_mesh(1, 1))
            ids = np.random.default_rng(0).integers(3, cfg.vocab_size, size=(1, text_len)).astype(np.int32)
            ref = forward_dense(weights, cfg, jnp.asarray(ids), jnp.ones_like(jnp.asarray(ids)))
            ref_gen = greedy_generate(weights, cfg, [ids[0, :16].tolist()], gen_len)[0]
            for name in schemes:
                qcfg, qweights = load_model(path, make_mesh(1, 1), quantization=name)
                out = forward_dense(qweights, qcfg, jnp.asarray(ids), jnp.ones_like(jnp.asarray(ids)))
                p, q = jax.nn.log_softmax(ref), jax.nn.log_softmax(out)
                kl = float((jnp.exp(p) * (p - q)).sum(-1).mean())
                top1 = float((ref.argmax(-1) == out.argmax(-1)).mean())
                gen = greedy_generate(qweights, qcfg, [ids[0, :16].tolist()], gen_len)[0]
                agree = float(np.mean(np.asarray(gen) == np.asarray(ref_gen)))
                first = next((i for i, (a, b) in enumerate(zip(gen, ref_gen)) if a != b), gen_len)
                rows.append(dict(family=variant, scheme=name, kl=kl, top1=top1, greedy_agreement=agree,
                                 first_divergence=first))
                print(json.dumps(rows[-1]), flush=True)
    return rows


def speed(schemes: list[str], preset: str, batches: list[int], context: int, steps: int, repeats: int) -> list[dict]:
    import jax.numpy as jnp

    from bench_engine import preset_config, run_batch
    from jaxserve.config import ModelConfig
    from jaxserve.model.weights import init_random
    from jaxserve.quant.scheme import online_scheme

    base = ModelConfig.from_hf(preset_config(preset))
    rows = []
    for batch in batches:
        for name in ["float32", *schemes]:
            cfg = base if name == "float32" else dataclasses.replace(base, quantization=online_scheme(name))
            weights = init_random(cfg, seed=0, dtype=jnp.float32)
            row = run_batch(cfg, weights, batch, context, steps, repeats, breakdown=True)
            rows.append(dict(scheme=name, batch=batch, step_ms=row["step_ms"], recompiles=row["recompiles"],
                             **{f"{k}_ms": v for k, v in row["breakdown_ms"].items()}))
            print(json.dumps(rows[-1]), flush=True)
    return rows


def bytes_and_plan(schemes: list[str]) -> list[dict]:
    import jax
    import jax.numpy as jnp

    from jaxserve.config import EngineConfig, ModelConfig
    from jaxserve.layouts import make_layout
    from jaxserve.model import weights as W
    from jaxserve.plan import decode_step, plan_deployment
    from jaxserve.quant.scheme import online_scheme, qtype_bits
    from jaxserve.targets import parse_target

    base = ModelConfig.from_hf(QWEN3_8B)
    params = sum(int(math.prod(s.shape)) for s in jax.tree.leaves(W.abstract(base), is_leaf=W.is_spec))
    rows = []
    for name in ["bfloat16", *schemes]:
        cfg = base if name == "bfloat16" else dataclasses.replace(base, quantization=online_scheme(name))
        specs = W.abstract(cfg, jnp.bfloat16)
        total = sum(int(math.prod(s.shape)) * qtype_bits(s.dtype) / 8
                    for s in jax.tree.leaves(specs, is_leaf=W.is_spec))
        layer_specs = jax.tree.leaves(specs.layers, is_leaf=W.is_spec)
        layer_params = sum(int(math.prod(s.shape)) for s in layer_specs if s.init in ("normal", "quantized"))
        layer_bytes = sum(int(math.prod(s.shape)) * qtype_bits(s.dtype) / 8 for s in layer_specs
                          if s.init in ("normal", "quantized", "scale", "zero_point"))
        row = dict(scheme=name, bytes_per_weight=total / params, projection_bytes_per_weight=layer_bytes / layer_params,
                   weight_gib=total / 2 ** 30)
        for target in ("tpu-v6e:1x1", "gpu-h200:1x1x1"):
            t = parse_target(target)
            plan = plan_deployment(cfg, t, make_layout("tp", t.num_devices), EngineConfig(max_model_len=4096),
                                   jnp.bfloat16, context=2048, compile_programs=False)
            for b in (1, 64):
                row[f"{target} decode b={b} tok/s"] = decode_step(plan, b).tokens_per_s
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--schemes", default="int8,int4,fp8")
    ap.add_argument("--parts", default="quality,speed,plan")
    ap.add_argument("--speed-preset", default="bench-105m")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json-out")
    args = ap.parse_args(argv)
    schemes = args.schemes.split(",")
    parts = args.parts.split(",")
    result: dict = {"cpu": platform.processor() or platform.machine()}
    try:
        result["cpu"] = next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    if "quality" in parts:
        result["quality"] = quality(schemes)
        print("\n| scheme | mean KL (median over families) | worst KL | top-1 agreement (min) | greedy agreement over 256 (median, min) |")
        print("|---|---:|---:|---:|---:|")
        for s in schemes:
            r = [x for x in result["quality"] if x["scheme"] == s]
            print(f"| {s} | {statistics.median(x['kl'] for x in r):.2e} | {max(x['kl'] for x in r):.2e} | "
                  f"{min(x['top1'] for x in r):.3f} | {statistics.median(x['greedy_agreement'] for x in r):.3f}, "
                  f"{min(x['greedy_agreement'] for x in r):.3f} |")
    if "speed" in parts:
        result["speed"] = speed(schemes, args.speed_preset, [int(b) for b in args.batches.split(",")],
                                args.context, args.steps, args.repeats)
        print(f"\n{args.speed_preset}, context {args.context}, {result['cpu']}")
        print("| batch | scheme | step ms | forward ms | layers ms | lm_head ms | attention ms | sampler ms | recompiles |")
        print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
        for r in result["speed"]:
            print(f"| {r['batch']} | {r['scheme']} | {r['step_ms']:.1f} | {r['forward_ms']:.1f} | "
                  f"{r['layers_and_rest_ms']:.1f} | {r['lm_head_ms']:.1f} | {r['attention_ms']:.1f} | "
                  f"{r['sampler_ms']:.1f} | {r['recompiles']} |")
    if "plan" in parts:
        result["plan"] = bytes_and_plan(schemes)
        print("\nQwen3-8B shape, bf16 compute, context 2048, roofline (no compile)")
        keys = [k for k in result["plan"][0] if "tok/s" in k]
        print("| scheme | bytes/weight (all) | bytes/weight (projections) | weights GiB | " + " | ".join(keys) + " |")
        print("|---|---:|---:|---:|" + "---:|" * len(keys))
        for r in result["plan"]:
            print(f"| {r['scheme']} | {r['bytes_per_weight']:.3f} | {r['projection_bytes_per_weight']:.3f} | "
                  f"{r['weight_gib']:.2f} | " + " | ".join(f"{r[k]:.0f}" for k in keys) + " |")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
