"""Speculative decoding (n-gram prompt lookup, or an EAGLE-3 head) against plain decoding: TPOT per batch size.

    python scripts/bench_spec.py --preset bench-105m --batches 1,4,16,64
    python scripts/bench_spec.py --method eagle3 --batches 1,4,16 --workloads greedy

Two engines on the same random-weight model and the default engine sizes (the capacity planner's,
with --max-num-seqs raised to the largest batch; async scheduling on, as users run it): one plain,
one with --speculative-config '{"method": "ngram", "num_speculative_tokens": K}'. For each batch
size B and workload, B requests start at once; each request's TPOT is (last token - first token) /
(tokens - 1) from the engine's own step loop (no HTTP), the median over requests is taken, and the
run is repeated (fresh prompts each time: no prefix-cache hits) with the median reported.

Workloads: `greedy` (temperature 0) and `sampled` (temperature 1, top_p 0.95). A random-weight
model's greedy output falls into loops that prompt lookup then predicts, so the greedy numbers show
what n-gram speculation gives on repetitive text (code edits, quoting, templated output); the
sampled workload rarely repeats, so it shows the cost of drafts that are mostly rejected. The
acceptance figures say which regime each row is in.

`--method eagle3` proposes with an EAGLE-3 head instead: `--head DIR`, or (default) a random head
written for the preset in the Hugging Face layout (tests/eagle3_heads.py, needs the test extra)
with a 32,000-token draft vocabulary like the published heads.
A random head's drafts are almost never accepted, so that run measures what the head costs: its
fill after every target step and its k - 1 proposal forwards, with nothing gained back.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_common import cpu_model, engine_run_args, run_requests  # noqa: E402
from bench_engine import PRESETS, preset_model  # noqa: E402

DRAFT_VOCAB = 32000  # the published EAGLE-3 heads' draft vocabulary (of Llama 3's 128,256)
WORKLOADS = {"greedy": dict(temperature=0.0), "sampled": dict(temperature=1.0, top_p=0.95)}


def make_core(model_cfg, weights, max_num_seqs: int, spec: dict | None):
    from jaxserve.core.config import EngineConfig
    from jaxserve.engine.engine_core import EngineCore
    from jaxserve.parallel.sharding import make_mesh

    core = EngineCore(model_cfg, weights, EngineConfig(max_num_seqs=max_num_seqs, speculative_config=spec),
                      make_mesh(1, 1))
    warm = core.runner.warmup()
    return core, warm


def random_head(preset: str, model_cfg) -> Path:
    """A random EAGLE-3 head for the preset's model, written under /tmp (HF layout)."""
    import types

    sys.path.insert(0, str(ROOT / "tests"))
    from eagle3_heads import head_config, write_head

    out = Path(f"/tmp/jaxserve-bench-eagle3-{preset}")
    target = types.SimpleNamespace(config=types.SimpleNamespace(
        hidden_size=model_cfg.hidden_size, vocab_size=model_cfg.vocab_size,
        max_position_embeddings=model_cfg.max_position_embeddings, num_hidden_layers=model_cfg.num_layers))
    n = model_cfg.num_layers
    config = head_config(target, draft_vocab=DRAFT_VOCAB, aux_layers=[1, n // 2, n - 1],
                         intermediate_size=model_cfg.intermediate_size,
                         num_attention_heads=model_cfg.num_heads, num_key_value_heads=model_cfg.num_kv_heads,
                         head_dim=model_cfg.head_dim)
    write_head(out, config)
    return out


def run_once(core, batch: int, prompt_len: int, max_tokens: int, workload: str, seed: int) -> dict:
    from jaxserve.core.request import Request
    from jaxserve.core.sampling_params import SamplingParams

    rng = random.Random(seed)
    vocab = core.model_cfg.vocab_size
    stats = core.scheduler.spec_stats
    before = stats.copy() if stats is not None else None
    row = run_requests(core, [
        Request(f"r{seed}-{i}", [rng.randrange(vocab) for _ in range(prompt_len)],
                SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=seed * 1000 + i, **WORKLOADS[workload]))
        for i in range(batch)])
    if stats is not None:
        d = stats.since(before)
        row.update(mean_acceptance_length=d.mean_acceptance_length, acceptance_rate=d.acceptance_rate,
                   drafts=d.num_drafts)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="bench-105m", choices=sorted(PRESETS))
    ap.add_argument("--batches", default="1,4,16,64")
    ap.add_argument("--workloads", default="greedy,sampled")
    ap.add_argument("--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--disable-by-batch-size", type=int, default=None,
                    help="the speculative config's disable_by_batch_size (default: unset)")
    ap.add_argument("--method", default="ngram", choices=("ngram", "eagle3"))
    ap.add_argument("--head", default=None, help="eagle3: the head's directory (default: a random head)")
    engine_run_args(ap)
    args = ap.parse_args(argv)

    model_cfg, weights = preset_model(args.preset)
    batches = [int(b) for b in args.batches.split(",")]
    spec = {"method": args.method, "num_speculative_tokens": args.num_speculative_tokens}
    if args.method == "eagle3":
        spec["model"] = args.head or str(random_head(args.preset, model_cfg))
    if args.disable_by_batch_size is not None:
        spec["disable_by_batch_size"] = args.disable_by_batch_size
    cores = {name: make_core(model_cfg, weights, max(batches), cfg) for name, cfg in (("plain", None), ("spec", spec))}
    print(json.dumps({name: {"warmup_s": round(w, 1)} for name, (_, w) in cores.items()}), flush=True)
    rows = []
    for workload in args.workloads.split(","):
        for b in batches:
            runs = {name: [] for name in cores}
            for r in range(args.repeats):  # interleaved, so drift of a noisy host hits both alike
                for name, (core, _) in cores.items():
                    runs[name].append(run_once(core, b, args.prompt_len, args.max_tokens, workload, seed=r + 1))
            row = {"workload": workload, "batch": b}
            for name, rs in runs.items():
                for key in rs[0]:
                    row[f"{name}_{key}"] = statistics.median(x[key] for x in rs)
            row["tpot_ratio"] = row["plain_tpot_ms"] / row["spec_tpot_ms"]
            row["recompiles"] = sum(c.runner.compilations_after_warmup for c, _ in cores.values())
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"\nCPU: {cpu_model()}; preset {args.preset}; prompt {args.prompt_len}, {args.max_tokens} tokens; "
          f"{spec}; median of {args.repeats}")
    m = args.method
    print(f"| workload | batch | plain TPOT ms | {m} TPOT ms | TPOT ratio | mean acceptance length | acceptance | "
          f"plain tok/s | {m} tok/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['workload']} | {r['batch']} | {r['plain_tpot_ms']:.1f} | {r['spec_tpot_ms']:.1f} | "
              f"{r['tpot_ratio']:.2f}x | {r['spec_mean_acceptance_length']:.2f} | "
              f"{100 * r['spec_acceptance_rate']:.0f}% | "
              f"{r['plain_tokens_per_s']:.0f} | {r['spec_tokens_per_s']:.0f} |")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
