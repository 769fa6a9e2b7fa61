"""Time to first token of a request whose 1,000-token prefix was pushed out of the device pool:
served from the host KV tier (--kv-offload-gib) against recomputed (no tier), in one run.

    python scripts/bench_host_tier.py --preset bench-105m --repeats 5

Each repeat: the shared prefix + a fresh 8-token suffix is served once (its pages enter the prefix
cache), two unrelated 1,000-token prompts push it out of an 80-page pool, then the prefix + another
fresh suffix is timed from add_request to its first token. Engines at their defaults otherwise
(float32 on a CPU, async scheduling); medians reported.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_common import cpu_model  # noqa: E402
from bench_engine import PRESETS, preset_model  # noqa: E402


def ttft(core, request) -> float:
    t0 = time.perf_counter()
    core.add_request(request)
    while True:
        for event in core.step():
            if event.request_id == request.request_id and event.token_id is not None:
                seconds = time.perf_counter() - t0
                core.abort(request.request_id)
                while core.has_work():
                    core.step()
                return seconds


def run(cfg, weights, offload: float | None, prefix_len: int, repeats: int) -> dict:
    import numpy as np

    from jaxserve.core.config import EngineConfig
    from jaxserve.engine.engine_core import EngineCore
    from jaxserve.core.request import Request
    from jaxserve.core.sampling_params import SamplingParams
    from jaxserve.parallel.sharding import make_mesh

    engine = EngineConfig(num_kv_pages=80, page_size=16, max_model_len=prefix_len + 64, max_num_seqs=4,
                          kv_offload_gib=offload)
    core = EngineCore(cfg, weights, engine, make_mesh(1, 1))
    core.runner.warmup()
    rng = np.random.default_rng(0)
    vocab = cfg.vocab_size
    prefix = rng.integers(10, vocab, prefix_len).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=1)
    times = []
    for r in range(repeats + 1):
        suffix = lambda: rng.integers(10, vocab, 8).tolist()  # noqa: E731
        ttft(core, Request(f"warm{r}", prefix + suffix(), params))
        for k in range(2):
            ttft(core, Request(f"fill{r}.{k}", rng.integers(10, vocab, prefix_len).tolist(), params))
        seconds = ttft(core, Request(f"timed{r}", prefix + suffix(), params))
        if r:  # the first repeat compiles nothing (warm-up did) but fills caches: dropped
            times.append(seconds)
    stats = core.stats()
    return {"ttft_ms": [round(t * 1e3, 1) for t in times], "median_ms": round(statistics.median(times) * 1e3, 1),
            "host_hit_tokens": stats.host_hit_tokens, "prefix_cache_hits": stats.prefix_cache_hits,
            "compilations_after_warmup": core.runner.compilations_after_warmup}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="bench-105m", choices=sorted(PRESETS))
    ap.add_argument("--prefix", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    cfg, weights = preset_model(args.preset)
    out = {"cpu": cpu_model(), "preset": args.preset, "prefix_tokens": args.prefix}
    out["recompute"] = run(cfg, weights, None, args.prefix, args.repeats)
    out["host_tier"] = run(cfg, weights, 1.0, args.prefix, args.repeats)
    out["speedup"] = round(out["recompute"]["median_ms"] / out["host_tier"]["median_ms"], 2)
    print(json.dumps(out, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
