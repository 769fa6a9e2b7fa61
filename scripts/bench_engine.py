"""Engine-level decode throughput against the machine's roofline, and where the step time goes.

    python scripts/bench_engine.py --preset bench-small --batches 1,8,32,128 --context 256

For each batch size B: B requests with `--context`-token prompts are prefilled, then `--steps`
decode steps are timed (median of `--repeats` runs). In the same run the copy bandwidth and the
matmul rate are measured (scripts/roofline.py), and each row reports achieved tokens/s, the
bound max(bytes/bandwidth, FLOPs/rate), the fraction of the bound reached, and the host share of
the step (scheduling + input building + update, from EngineCore.timings). No HTTP: this isolates
the engine from the server.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

PRESETS = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=1024),
    "bench-small": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
                        num_key_value_heads=4, head_dim=32, vocab_size=151936),
    "bench-105m": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                       num_key_value_heads=4, head_dim=64, vocab_size=151936),
    # bench-105m with every MLP a Qwen3-MoE block: 8 experts of width 768, top-2, so a token passes
    # through 1536 MLP columns per layer as in bench-105m (the same active parameters, 4x the MLP weights)
    "bench-105m-moe": dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=512,
                           intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                           head_dim=64, vocab_size=151936, num_experts=8, num_experts_per_tok=2,
                           moe_intermediate_size=768, norm_topk_prob=True),
}


def preset_config(name: str) -> dict:
    return {**dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", max_position_embeddings=4096,
                   tie_word_embeddings=True, rms_norm_eps=1e-6, rope_theta=1e6, dtype="float32"), **PRESETS[name]}


def preset_model(name: str):
    """(ModelConfig, float32 random weights, seed 0) of a preset."""
    import jax.numpy as jnp

    from jaxserve.core.config import ModelConfig
    from jaxserve.model.weights import init_random

    cfg = ModelConfig.from_hf(preset_config(name))
    return cfg, init_random(cfg, seed=0, dtype=jnp.float32)


def run_batch(model_cfg, weights, batch: int, context: int, steps: int, repeats: int,
              breakdown: bool = False, kv_cache_dtype: str = "auto") -> dict:
    from jaxserve.core.config import EngineConfig
    from jaxserve.engine.engine_core import EngineCore
    from jaxserve.core.request import Request
    from jaxserve.core.sampling_params import SamplingParams
    from jaxserve.parallel.sharding import make_mesh

    page_size = 16
    max_tokens = steps * (repeats + 1) + 16  # headroom for the breakdown's extra step
    max_len = context + max_tokens + 8
    budget = max(batch, 512)
    ecfg = EngineConfig(page_size=page_size, num_kv_pages=batch * (-(-max_len // page_size)) + 8,
                        max_num_seqs=batch, max_num_batched_tokens=budget, max_model_len=max_len,
                        token_buckets=tuple(sorted({batch, budget})), seq_buckets=(batch,),
                        enable_prefix_caching=False, kv_cache_dtype=kv_cache_dtype)
    core = EngineCore(model_cfg, weights, ecfg, make_mesh(1, 1))
    warm = core.runner.warmup()
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(batch):
        core.add_request(Request(f"b{i}", [(7 * i + j) % 1000 + 1 for j in range(context)], params))
    started: set[str] = set()
    while len(started) < batch:  # prefill everyone (each request has sampled its first token)
        started.update(e.request_id for e in core.step())
    for _ in range(steps):  # settle into pure decode
        core.step()
    times, host = [], []
    for _ in range(repeats):
        core.timings.__init__()
        t0 = time.perf_counter()
        for _ in range(steps):
            core.step()
        times.append(time.perf_counter() - t0)
        tm = core.timings
        host.append((tm.schedule + tm.build + tm.update) / max(times[-1], 1e-9))
    step_s = statistics.median(times) / steps
    row = {"batch": batch, "warmup_s": round(warm, 1), "step_ms": step_s * 1e3,
           "tokens_per_s": batch / step_s, "host_fraction": statistics.median(host),
           "recompiles": core.runner.compilations_after_warmup}
    if breakdown:
        row["breakdown_ms"] = step_breakdown(core, repeats=max(3, repeats))
        row["breakdown_ms"]["host"] = statistics.median(host) * step_s * 1e3
        row["breakdown_ms"]["detokenize"] = detokenize_ms(batch, steps)
    return row


def _no_attention(q, k_pages, v_pages, *args, **kwargs):
    """Stands in for attention in the ablated forward (same shapes, no work)."""
    return q


def _timed_ms(fn, repeats: int) -> float:
    """Median milliseconds of fn() run to completion (after one warm-up call)."""
    import jax

    import roofline as rl

    return rl.median_time(lambda: jax.block_until_ready(fn()), repeats) * 1e3


def capture_step_inputs(core):
    """Runs one engine step and returns the StepInputs its forward was given."""
    runner = core.runner
    captured = []
    real_forward = runner.forward
    runner.forward = lambda inputs: captured.append(inputs) or real_forward(inputs)
    try:
        core.step()
    finally:
        runner.forward = real_forward
    return captured[-1]


def step_breakdown(core, repeats: int) -> dict[str, float]:
    """Milliseconds of one steady decode step's device programs, each timed alone (synchronously):
    the forward program, the same forward with attention removed (the difference is attention),
    the lm_head product on the step's logits rows alone, and the sampler program."""
    import jax
    import jax.numpy as jnp

    from jaxserve.model.transformer import lm_head

    runner = core.runner
    inputs = capture_step_inputs(core)

    def forward():
        logits, runner.kv = runner._forward(inputs.arrays)
        return logits

    out = {"forward": _timed_ms(forward, repeats)}
    real_attention = runner._attention
    runner._attention = _no_attention
    try:
        out["attention"] = max(0.0, out["forward"] - _timed_ms(forward, repeats))
    finally:
        runner._attention = real_attention
    logits = forward()
    rows = jnp.zeros((logits.shape[0], core.model_cfg.hidden_size), runner.dtype)
    head = jax.jit(lm_head)
    out["lm_head"] = _timed_ms(lambda: head(runner.weights, rows), repeats)
    out["layers_and_rest"] = max(0.0, out["forward"] - out["attention"] - out["lm_head"])
    out["sampler"] = _timed_ms(lambda: runner._sample(logits, inputs.sampling), repeats)
    return out


def detokenize_ms(batch: int, steps: int) -> float:
    """Milliseconds per step to stream one new token for each of `batch` sequences through the
    incremental detokenizer (the real Qwen vocabulary of the embedded default model)."""
    from jaxserve.default_model import ensure_default_model
    from jaxserve.text.detokenizer import IncrementalDetokenizer
    from jaxserve.text.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(ensure_default_model())
    text = (ROOT / "README.md").read_text()
    ids = tok.encode(text)[: steps * 4 + 64]
    detoks = [IncrementalDetokenizer(tok, ids[:32]) for _ in range(batch)]
    t0 = time.perf_counter()
    for i in range(steps):
        for j, d in enumerate(detoks):
            d.push([ids[32 + (i + j) % (len(ids) - 32)]])
    return (time.perf_counter() - t0) / steps * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="bench-small", choices=sorted(PRESETS))
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--breakdown", action="store_true",
                    help="also time each part of a decode step alone (forward, attention, lm_head, sampler, "
                         "host, detokenization)")
    ap.add_argument("--json-out")
    args = ap.parse_args(argv)

    import jax.numpy as jnp

    import roofline as rl
    from jaxserve.core.config import ModelConfig
    from jaxserve.model.weights import init_random

    cfg_dict = preset_config(args.preset)
    model_cfg = ModelConfig.from_hf(cfg_dict)
    weights = init_random(model_cfg, seed=0, dtype=jnp.float32)
    bw = rl.measure_copy_bandwidth(backend="numpy")
    read_bw = rl.measure_read_bandwidth()
    rate, _ = rl.measure_matmul_rate()
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "config.json").write_text(json.dumps(cfg_dict))
        rows = []
        for b in [int(x) for x in args.batches.split(",")]:
            row = run_batch(model_cfg, weights, b, args.context, args.steps, args.repeats, args.breakdown)
            bound = rl.roofline(Path(d) / "config.json", b, args.context, bw, rate)
            row["bound_tokens_per_s"] = bound["decode_tokens_per_s"]
            row["fraction_of_bound"] = row["tokens_per_s"] / row["bound_tokens_per_s"]
            row["bound_kind"] = bound["decode_bound"]
            read_bound = rl.roofline(Path(d) / "config.json", b, args.context, read_bw, rate)
            row["fraction_of_read_bound"] = row["tokens_per_s"] / read_bound["decode_tokens_per_s"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"\nmachine: copy {bw / 1e9:.1f} GB/s, read {read_bw / 1e9:.1f} GB/s, matmul {rate / 1e9:.1f} GFLOP/s; "
          f"preset {args.preset}, context {args.context}")
    print("| batch | step ms | tok/s | bound tok/s | % of bound | limited by | % of bound at read bandwidth | host share |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['step_ms']:.1f} | {r['tokens_per_s']:.0f} | {r['bound_tokens_per_s']:.0f} | "
              f"{100 * r['fraction_of_bound']:.0f}% | {r['bound_kind']} | {100 * r['fraction_of_read_bound']:.0f}% | "
              f"{100 * r['host_fraction']:.1f}% |")
    if args.breakdown:
        parts = ("forward", "attention", "lm_head", "layers_and_rest", "sampler", "host", "detokenize")
        print("\nWhere a decode step's time goes (ms, each part timed alone; attention = forward minus the "
              "forward without attention; host = scheduling + input building + update):")
        print("| batch | step ms | " + " | ".join(parts) + " | host + detokenize share |")
        print("|---" * (len(parts) + 3) + "|")
        for r in rows:
            b = r["breakdown_ms"]
            share = (b["host"] + b["detokenize"]) / r["step_ms"]
            print(f"| {r['batch']} | {r['step_ms']:.1f} | " + " | ".join(f"{b[k]:.1f}" for k in parts)
                  + f" | {100 * share:.1f}% |")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"bandwidth": bw, "read_bandwidth": read_bw, "matmul_rate": rate,
                                                     "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
