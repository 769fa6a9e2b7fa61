"""Multi-LoRA overhead: output throughput with adapters mixed in the batch vs the base model alone.

    python scripts/bench_lora.py --preset bench-small --batch 32 --adapters 4 --rank 16

Two engines on the same random-weight model and the default sizes (max_num_seqs = the batch):
`plain` without LoRA, `lora` with --enable-lora and N adapters of rank R on all seven projections
(written in PEFT's file format by this script; random factors). Workloads, each B requests with
fresh random prompts started together and run to completion: the plain engine on the base model;
the LoRA engine with every request on the base model (the cost of the LoRA path itself: every
token multiplies by every slot's A); the LoRA engine with the requests spread evenly over the N
adapters. Output tokens/s and TPOT (median over requests), median of interleaved repeats.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_common import cpu_model, engine_run_args, run_requests  # noqa: E402
from bench_engine import PRESETS, preset_model  # noqa: E402

MODULES = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def write_adapter(directory: Path, model_cfg, rank: int, seed: int) -> None:
    """A PEFT-format LoRA adapter with random factors on every projection of every layer."""
    from safetensors.numpy import save_file

    from jaxserve.lora.adapter import shapes

    rng = np.random.default_rng(seed)
    dims = shapes(model_cfg)
    tensors = {}
    for layer in range(model_cfg.num_layers):
        for module, block in MODULES.items():
            fan_in, fan_out = (int(np.prod(d)) for d in dims[module])
            key = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{key}.lora_A.weight"] = (rng.standard_normal((rank, fan_in)) * 0.02).astype(np.float32)
            tensors[f"{key}.lora_B.weight"] = (rng.standard_normal((fan_out, rank)) * 0.02).astype(np.float32)
    directory.mkdir(parents=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    (directory / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(MODULES), "bias": "none"}))


def run_once(core, batch: int, prompt_len: int, max_tokens: int, adapters: list[str | None], seed: int) -> dict:
    from jaxserve.core.request import Request
    from jaxserve.core.sampling_params import SamplingParams

    rng = random.Random(seed)
    vocab = core.model_cfg.vocab_size
    return run_requests(core, [
        Request(f"r{seed}-{i}", [rng.randrange(vocab) for _ in range(prompt_len)],
                SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                lora_name=adapters[i % len(adapters)]) for i in range(batch)])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="bench-small", choices=sorted(PRESETS))
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    engine_run_args(ap)
    args = ap.parse_args(argv)

    from jaxserve.core.config import EngineConfig
    from jaxserve.engine.engine_core import EngineCore
    from jaxserve.parallel.sharding import make_mesh

    model_cfg, weights = preset_model(args.preset)
    names = [f"adapter{i}" for i in range(args.adapters)]
    with tempfile.TemporaryDirectory() as d:
        for i, name in enumerate(names):
            write_adapter(Path(d) / name, model_cfg, args.rank, seed=i)
        configs = {"plain": EngineConfig(max_num_seqs=args.batch),
                   "lora": EngineConfig(max_num_seqs=args.batch, enable_lora=True, max_loras=args.adapters,
                                        max_lora_rank=args.rank,
                                        lora_modules=tuple((n, str(Path(d) / n)) for n in names))}
        cores = {}
        for key, cfg in configs.items():
            cores[key] = EngineCore(model_cfg, weights, cfg, make_mesh(1, 1))
            print(json.dumps({key: {"warmup_s": round(cores[key].runner.warmup(), 1)}}), flush=True)
        workloads = {"base, no LoRA": ("plain", [None]), "base, LoRA engine": ("lora", [None]),
                     f"{args.adapters} adapters mixed": ("lora", names)}
        runs = {w: [] for w in workloads}
        for r in range(args.repeats):
            for w, (key, adapters) in workloads.items():
                runs[w].append(run_once(cores[key], args.batch, args.prompt_len, args.max_tokens, adapters, seed=r + 1))
        rows = {w: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for w, rs in runs.items()}
        recompiles = sum(c.runner.compilations_after_warmup for c in cores.values())
    base = rows["base, no LoRA"]["tokens_per_s"]
    print(json.dumps({"rows": rows, "recompiles": recompiles}), flush=True)
    print(f"\nCPU: {cpu_model()}; preset {args.preset}; batch {args.batch}; rank {args.rank}; "
          f"prompt {args.prompt_len}, {args.max_tokens} tokens; median of {args.repeats}")
    print("| workload | output tok/s | vs base, no LoRA | TPOT ms |")
    print("|---|---|---|---|")
    for w, row in rows.items():
        print(f"| {w} | {row['tokens_per_s']:.0f} | {row['tokens_per_s'] / base:.2f}x | {row['tpot_ms']:.1f} |")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"rows": rows, "recompiles": recompiles}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
