"""Output tokens/s of one request burst through `EngineCore` with the default EngineConfig (sizes
resolved from this machine, as `jaxserve serve` resolves them), no HTTP: the engine-side A/B of a
scheduling or bucket change. Prompts of random ids (30-500 tokens) and output lengths (16-128)
drawn as in bench_vs_peers' bench-small burst, greedy, ignore_eos. Run it from each tree being
compared, alternately (the tree is the one this script lives in):

    python scripts/bench_engine_burst.py --preset bench-small --requests 64 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_engine import PRESETS, preset_model  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="bench-small", choices=sorted(PRESETS))
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-range", default="30,500", help="min,max prompt tokens")
    ap.add_argument("--output-range", default="16,128", help="min,max output tokens")
    ap.add_argument("--repeats", type=int, default=2, help="bursts run after warm-up (the median is reported)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    import jax

    jax.config.update("jax_default_matmul_precision", "highest")
    from jaxserve.core.config import EngineConfig
    from jaxserve.engine.engine_core import EngineCore
    from jaxserve.core.request import Request
    from jaxserve.core.sampling_params import SamplingParams
    from jaxserve.parallel.sharding import make_mesh

    cfg, weights = preset_model(args.preset)
    core = EngineCore(cfg, weights, EngineConfig(), make_mesh(1, 1))
    t0 = time.perf_counter()
    core.runner.warmup()
    warmup_s = time.perf_counter() - t0
    rng = random.Random(args.seed)
    p_lo, p_hi = map(int, args.prompt_range.split(","))
    o_lo, o_hi = map(int, args.output_range.split(","))
    shapes = [(rng.randint(p_lo, p_hi), rng.randint(o_lo, o_hi)) for _ in range(args.requests)]
    rates, steps = [], 0
    for rep in range(args.repeats):
        for i, (prompt, out) in enumerate(shapes):
            ids = [rng.randint(1, cfg.vocab_size - 1) for _ in range(prompt)]
            core.add_request(Request(f"r{rep}-{i}", ids, SamplingParams(temperature=0.0, max_tokens=out,
                                                                         ignore_eos=True)))
        tokens = steps = 0
        t0 = time.perf_counter()
        while core.has_work():
            tokens += sum(e.token_id is not None for e in core.step())
            steps += 1
        rates.append(tokens / (time.perf_counter() - t0))
    print(json.dumps({"preset": args.preset, "requests": args.requests, "tokens_per_s": statistics.median(rates),
                      "each_tokens_per_s": [round(r, 1) for r in rates], "steps": steps,
                      "warmup_s": round(warmup_s, 1), "programs": core.runner.capacity.num_programs,
                      "recompiles": core.runner.compilations_after_warmup}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
