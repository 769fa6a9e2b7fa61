"""Weight quantization: quality against the unquantized model, decode speed on this CPU, and the
planner's estimate for accelerators.

    JAX_PLATFORMS=cpu python scripts/bench_quant.py [--parts quality,speed,plan,kv-quality,kv-speed,kv-plan]
        [--schemes int8,int4,fp8] [--kv-cache-dtypes int8,fp8_e4m3,fp8_e5m2] [--speed-preset bench-105m]
        [--batches 1,64]

(the plan parts' H200 columns compile-target a GPU: they need `pip install -e '.[gpu]'`)

1. Quality, on every parity family (tests/hf_models.py: tiny random models written by transformers):
   mean KL(f32 || quantized) of the next-token distributions and top-1 agreement over a fixed
   128-token text, and greedy-token agreement over 256 generated tokens (the share of positions
   where the two greedy continuations agree, and the first position where they differ).
2. Speed on this CPU: one decode step (forward + sampler) at each batch, float32 against each
   scheme, on a random model of `--speed-preset` (bench_engine.run_batch with its breakdown), so the
   projections' share (layers) is visible apart from lm_head and attention.
3. Bytes per weight (all leaves, scales included) and the planner's decode estimate (roofline, no
   compile) for a Qwen3-8B-shaped model on TPU v6e and an H200, bf16 against each scheme.
4. KV cache dtypes (--kv-cache-dtype; kv-quality, kv-speed, kv-plan): the same quality measures
   against float32 pages (KL/top-1 teacher-forced through the serving forward, greedy through the
   engine) with the relative error of per-token against per-page scales; decode step time at each
   batch with float32 weights; bytes per KV token and the planner's pool and decode estimate.
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
    from jaxserve.parallel.sharding import make_mesh

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


def _scale_granularity_error(pool, kv_dtypes: list[str]) -> dict[str, dict]:
    """Relative RMS error of every layer's K and V (float32 pool) quantized with one scale per token
    and head (what the pool stores) against one scale per page and head (16 tokens)."""
    import jax.numpy as jnp
    import numpy as np

    from jaxserve.quant import kv as kv_quant
    from kernels_pallas.kv_quant import quantize

    out = {}
    for name in kv_dtypes:
        dtype = kv_quant.storage_dtype(name, jnp.float32)
        err = {"per_token": [], "per_page": []}
        for x in [*pool.k, *pool.v]:                                   # [P, ps, KVH, D]
            x = jnp.asarray(x)
            values, scales = quantize(x, dtype)                        # per token and head
            err["per_token"].append(values.astype(jnp.float32) * scales[..., None] - x)
            page = jnp.swapaxes(x, 1, 2).reshape(x.shape[0], x.shape[2], -1)  # [P, KVH, ps * D]
            values, scales = quantize(page, dtype)                     # per page and head
            back = (values.astype(jnp.float32) * scales[..., None]).reshape(x.shape[0], x.shape[2], x.shape[1], -1)
            err["per_page"].append(jnp.swapaxes(back, 1, 2) - x)
        norm = float(np.sqrt(sum(float(jnp.sum(x ** 2)) for x in [*pool.k, *pool.v])))
        out[name] = {f"rel_err_{k}": float(np.sqrt(sum(float(jnp.sum(e ** 2)) for e in v))) / norm
                     for k, v in err.items()}
    return out


def kv_quality(kv_dtypes: list[str], text_len: int = 128, gen_len: int = 256) -> list[dict]:
    """KV-cache quantization against float32 pages, per parity family: KL and top-1 agreement of the
    teacher-forced next-token distributions over a fixed text (serving forward, one 128-token chunk
    attending to its own quantized K/V), and greedy agreement over 256 tokens through the engine."""
    import jax
    import numpy as np

    from checkpoints import load_model
    from engine_utils import greedy, make_core, run_all
    from paged_forward import paged_logits
    from hf_models import VARIANTS, make_hf_model
    from jaxserve.model.dense import greedy_generate
    from jaxserve.core.request import Request
    from jaxserve.parallel.sharding import make_mesh

    rows = []
    for variant in sorted(VARIANTS):
        with tempfile.TemporaryDirectory() as d:
            path, _ = make_hf_model(variant, Path(d), max_position_embeddings=512)
            cfg, weights = load_model(path, make_mesh(1, 1))
            ids = np.random.default_rng(0).integers(3, cfg.vocab_size, size=text_len).tolist()
            ref, pool = paged_logits(weights, cfg, ids, "auto")
            granularity = _scale_granularity_error(pool, kv_dtypes)
            # the float noise floor: the engine on float32 pages against the dense parity path, both float32
            dense = greedy_generate(weights, cfg, [ids[:16]], gen_len)[0]
            gens = {}
            for name in ["auto", *kv_dtypes]:
                core = make_core(cfg, weights, kv_cache_dtype=name, max_model_len=16 + gen_len,
                                 num_kv_pages=2 * (16 + gen_len) // 4)
                gens[name] = run_all(core, [Request("r", ids[:16], greedy(gen_len))])["r"][0]
            for name in kv_dtypes:
                out, _ = paged_logits(weights, cfg, ids, name)
                p, q = jax.nn.log_softmax(ref), jax.nn.log_softmax(out)
                gen, ref_gen = gens[name], gens["auto"]
                rows.append(dict(
                    family=variant, kv_cache_dtype=name, kl=float((np.exp(p) * (p - q)).sum(-1).mean()),
                    top1=float((ref.argmax(-1) == out.argmax(-1)).mean()),
                    greedy_agreement=float(np.mean(np.asarray(gen) == np.asarray(ref_gen))),
                    first_divergence=next((i for i, (a, b) in enumerate(zip(gen, ref_gen)) if a != b), gen_len),
                    f32_engine_vs_dense_agreement=float(np.mean(np.asarray(ref_gen) == np.asarray(dense))),
                    **granularity[name]))
                print(json.dumps(rows[-1]), flush=True)
    return rows


def speed(preset: str, batches: list[int], context: int, steps: int, repeats: int, *, schemes: list[str] = (),
          kv_dtypes: list[str] = ()) -> list[dict]:
    """One decode step at each batch: float32 weights against each weight scheme (`schemes`, float32 pages),
    or float32 pages against each KV cache dtype (`kv_dtypes`, float32 weights)."""
    import jax.numpy as jnp

    from bench_engine import preset_config, run_batch
    from jaxserve.core.config import ModelConfig
    from jaxserve.model.weights import init_random
    from jaxserve.quant.scheme import online_scheme

    base = ModelConfig.from_hf(preset_config(preset))
    variants = [("scheme", name, name, "auto") for name in (["float32", *schemes] if schemes else [])]
    variants += [("kv_cache_dtype", name, "float32", name) for name in (["auto", *kv_dtypes] if kv_dtypes else [])]
    rows = []
    for batch in batches:
        for key, label, scheme, kv_dtype in variants:
            cfg = base if scheme == "float32" else dataclasses.replace(base, quantization=online_scheme(scheme))
            weights = init_random(cfg, seed=0, dtype=jnp.float32)
            row = run_batch(cfg, weights, batch, context, steps, repeats, breakdown=True, kv_cache_dtype=kv_dtype)
            rows.append({key: label, "batch": batch, "step_ms": row["step_ms"], "recompiles": row["recompiles"],
                         **{f"{k}_ms": v for k, v in row["breakdown_ms"].items()}})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def kv_plan(kv_dtypes: list[str]) -> list[dict]:
    """Bytes per KV token and the planner's pool and decode estimate (roofline, no compile) for a
    Qwen3-8B-shaped model in bf16 on TPU v6e and an H200, per KV cache dtype."""
    import jax.numpy as jnp

    from jaxserve.core.capacity import kv_bytes_per_token
    from jaxserve.core.config import EngineConfig, ModelConfig
    from jaxserve.parallel.layouts import make_layout
    from jaxserve.planning.plan import decode_step, plan_deployment
    from jaxserve.planning.targets import parse_target

    cfg = ModelConfig.from_hf(QWEN3_8B)
    rows = []
    for name in ["auto", *kv_dtypes]:
        row = dict(kv_cache_dtype=name, kv_bytes_per_token=kv_bytes_per_token(cfg, 2, 1, name))
        for target in ("tpu-v6e:1x1", "gpu-h200:1x1x1"):
            t = parse_target(target)
            plan = plan_deployment(cfg, t, make_layout("tp", t.num_devices),
                                   EngineConfig(max_model_len=8192, kv_cache_dtype=name), jnp.bfloat16,
                                   context=8192, compile_programs=False)
            row[f"{target} pool tokens"] = plan.max_kv_tokens
            for b in (1, 64):
                est = decode_step(plan, b)  # the largest batch <= b whose contexts the pool holds
                row[f"{target} decode b<={b} ctx=8192"] = f"{est.tokens_per_s:.0f} tok/s at b={est.batch}"
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def bytes_and_plan(schemes: list[str]) -> list[dict]:
    import jax
    import jax.numpy as jnp

    from jaxserve.core.config import EngineConfig, ModelConfig
    from jaxserve.parallel.layouts import make_layout
    from jaxserve.model import weights as W
    from jaxserve.planning.plan import decode_step, plan_deployment
    from jaxserve.quant.scheme import online_scheme, qtype_bits
    from jaxserve.planning.targets import parse_target

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


def _quality_table(rows: list[dict], variant: str, names: list[str], scale_error: bool = False) -> None:
    """Markdown rows of the quality measures over the families, one row per scheme / KV dtype."""
    print(f"\n| {variant} | mean KL (median over families) | worst KL | top-1 (min) | free-running greedy agreement over "
          "256 (median, min) |" + (" rel. error per token / per page (median) |" if scale_error else ""))
    print("|---|---:|---:|---:|---:|" + ("---:|" if scale_error else ""))
    for name in names:
        r = [x for x in rows if x[variant] == name]
        med = lambda key: statistics.median(x[key] for x in r)  # noqa: E731
        line = (f"| {name} | {med('kl'):.2e} | {max(x['kl'] for x in r):.2e} | {min(x['top1'] for x in r):.3f} | "
                f"{med('greedy_agreement'):.3f}, {min(x['greedy_agreement'] for x in r):.3f} |")
        if scale_error:
            line += f" {med('rel_err_per_token'):.4f} / {med('rel_err_per_page'):.4f} |"
        print(line)


def _speed_table(rows: list[dict], variant: str) -> None:
    """Markdown rows of one decode step and its breakdown (layers include the KV write)."""
    print(f"| batch | {variant} | step ms | forward ms | layers ms | lm_head ms | attention ms | sampler ms | recompiles |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['batch']} | {r[variant]} | {r['step_ms']:.1f} | {r['forward_ms']:.1f} | {r['layers_and_rest_ms']:.1f} "
              f"| {r['lm_head_ms']:.1f} | {r['attention_ms']:.1f} | {r['sampler_ms']:.1f} | {r['recompiles']} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--schemes", default="int8,int4,fp8")
    ap.add_argument("--parts", default="quality,speed,plan,kv-quality,kv-speed,kv-plan")
    ap.add_argument("--kv-cache-dtypes", default="int8,fp8_e4m3,fp8_e5m2")
    ap.add_argument("--speed-preset", default="bench-105m")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json-out")
    args = ap.parse_args(argv)
    schemes = args.schemes.split(",")
    kv_dtypes = args.kv_cache_dtypes.split(",")
    parts = args.parts.split(",")
    result: dict = {"cpu": platform.processor() or platform.machine()}
    try:
        result["cpu"] = next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    batches = [int(b) for b in args.batches.split(",")]
    if "quality" in parts:
        result["quality"] = quality(schemes)
        _quality_table(result["quality"], "scheme", schemes)
    if "kv-quality" in parts:
        result["kv_quality"] = kv_quality(kv_dtypes)
        _quality_table(result["kv_quality"], "kv_cache_dtype", kv_dtypes, scale_error=True)
    for part, variant, kw in (("speed", "scheme", dict(schemes=schemes)),
                              ("kv-speed", "kv_cache_dtype", dict(kv_dtypes=kv_dtypes))):
        if part in parts:
            rows = result[part.replace("-", "_")] = speed(args.speed_preset, batches, args.context, args.steps,
                                                          args.repeats, **kw)
            print(f"\n{args.speed_preset}, context {args.context}, float32 activations, {result['cpu']}")
            _speed_table(rows, variant)
    if "plan" in parts:
        result["plan"] = bytes_and_plan(schemes)
        print("\nQwen3-8B shape, bf16 compute, context 2048, roofline (no compile)")
        keys = [k for k in result["plan"][0] if "tok/s" in k]
        print("| scheme | bytes/weight (all) | bytes/weight (projections) | weights GiB | " + " | ".join(keys) + " |")
        print("|---|---:|---:|---:|" + "---:|" * len(keys))
        for r in result["plan"]:
            print(f"| {r['scheme']} | {r['bytes_per_weight']:.3f} | {r['projection_bytes_per_weight']:.3f} | "
                  f"{r['weight_gib']:.2f} | " + " | ".join(f"{r[k]:.0f}" for k in keys) + " |")
    if "kv-plan" in parts:
        result["kv_plan"] = kv_plan(kv_dtypes)
        print("\nQwen3-8B shape, bf16, max_model_len 8192, roofline (no compile)")
        keys = [k for k in result["kv_plan"][0] if k not in ("kv_cache_dtype", "kv_bytes_per_token")]
        print("| KV cache dtype | KV bytes/token | " + " | ".join(keys) + " |")
        print("|---|---:|" + "---:|" * len(keys))
        for r in result["kv_plan"]:
            print(f"| {r['kv_cache_dtype']} | {r['kv_bytes_per_token']} | " + " | ".join(str(r[k]) for k in keys) + " |")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
