"""What a JSON-schema constraint costs a decode step: the same batch decoded with and without it.

    python scripts/bench_structured.py                       # embedded default model, batch 64
    python scripts/bench_structured.py --preset bench-small  # a bigger random model, same vocabulary

B sampled requests (temperature 1, seeded) decode through an EngineCore with the defaults (async
scheduling on). In the constrained run every row follows a JSON schema whose arrays are long
enough that no row finishes inside the timed window; the unconstrained run decodes the same
prompts without it. The two alternate, `--repeats` times each, and the median step time of each
is reported with the overhead ratio and, from `EngineCore.timings.mask`, the host time spent
filling the grammar masks per step (llguidance's parallel filler). No HTTP.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

# Objects with an integer, a short string and an enum array, at least 1000 of them: a row keeps
# moving through keys, numbers, strings and separators and never reaches the end while timed.
SCHEMA = {"type": "array", "minItems": 1000, "items": {
    "type": "object", "additionalProperties": False, "required": ["id", "name", "tags"],
    "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 100000},
                   "name": {"type": "string", "maxLength": 12},
                   "tags": {"type": "array", "maxItems": 3, "items": {"enum": ["red", "green", "blue"]}}}}}


def build_core(preset: str | None, batch: int, max_len: int):
    """(EngineCore, Tokenizer) on the embedded default model, or on a bench preset's random weights
    (same Qwen vocabulary, so the default model's tokenizer drives the grammars)."""
    from jaxserve.core.config import EngineConfig
    from jaxserve.default_model import ensure_default_model
    from jaxserve.engine.loading import load_engine_core
    from jaxserve.text.tokenizer import Tokenizer

    ecfg = EngineConfig(max_num_seqs=batch, max_model_len=max_len, enable_prefix_caching=False)
    if preset is None:
        core, tokenizer, _ = load_engine_core(None, ecfg)
        return core, tokenizer
    import jax.numpy as jnp

    from bench_engine import preset_config
    from jaxserve.core.config import ModelConfig
    from jaxserve.engine.engine_core import EngineCore
    from jaxserve.model.weights import init_random
    from jaxserve.parallel.sharding import make_mesh

    model_cfg = ModelConfig.from_hf(preset_config(preset))
    core = EngineCore(model_cfg, init_random(model_cfg, seed=0, dtype=jnp.float32), ecfg, make_mesh(1, 1))
    core.runner.warmup()
    return core, Tokenizer.from_pretrained(ensure_default_model())


def timed_window(core, tokenizer, grammar, batch: int, steps: int, tag: str) -> dict:
    """Adds `batch` requests, decodes until all have started plus a few steps, then times `steps`
    steps; aborts them all afterwards."""
    from jaxserve.core.request import Request
    from jaxserve.core.sampling_params import SamplingParams
    from jaxserve.structured import StructuredOutputs

    spec = StructuredOutputs(json=SCHEMA) if grammar is not None else None
    params = SamplingParams(temperature=1.0, max_tokens=steps * 3 + 64, ignore_eos=True, structured_outputs=spec)
    ids = []
    for i in range(batch):
        rid = f"{tag}-{i}"
        prompt = tokenizer.encode(f"Record {i}: list the items as JSON.")
        core.add_request(Request(rid, prompt, dataclasses.replace(params, seed=i),
                                 tokenizer.eos_token_ids, grammar=grammar))
        ids.append(rid)
    started: set[str] = set()
    while len(started) < batch:
        started.update(e.request_id for e in core.step())
    for _ in range(4):
        core.step()
    core.timings.__init__()
    t0 = time.perf_counter()
    finished = 0
    for _ in range(steps):
        finished += sum(e.finish_reason is not None for e in core.step())
    elapsed = time.perf_counter() - t0
    tm = core.timings
    for rid in ids:
        core.abort(rid)
    while core.has_work():
        core.step()
    return {"step_ms": elapsed / steps * 1e3, "mask_ms": tm.mask / max(tm.steps, 1) * 1e3,
            "finished_in_window": finished}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default=None, help="a bench_engine.py preset instead of the embedded default model")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json-out")
    args = ap.parse_args(argv)

    from bench_common import machine_info
    from jaxserve.structured import GrammarCompiler, StructuredOutputs

    core, tokenizer = build_core(args.preset, args.batch, max_len=args.steps * 3 + 160)
    compiler = GrammarCompiler(tokenizer.hf, core.model_cfg.vocab_size, tokenizer.eos_token_ids)
    t0 = time.perf_counter()
    grammar = compiler.compile(StructuredOutputs(json=SCHEMA))
    compile_ms = (time.perf_counter() - t0) * 1e3
    runs: dict[str, list[dict]] = {"unconstrained": [], "constrained": []}
    for r in range(args.repeats):
        runs["unconstrained"].append(timed_window(core, tokenizer, None, args.batch, args.steps, f"u{r}"))
        runs["constrained"].append(timed_window(core, tokenizer, grammar, args.batch, args.steps, f"c{r}"))
    med = {k: statistics.median(x["step_ms"] for x in v) for k, v in runs.items()}
    mask_ms = statistics.median(x["mask_ms"] for x in runs["constrained"])
    result = {"machine": machine_info(), "model": args.preset or "jaxserve-tiny (embedded default)",
              "batch": args.batch, "steps": args.steps, "repeats": args.repeats,
              "schema_compile_ms": compile_ms, "unconstrained_step_ms": med["unconstrained"],
              "constrained_step_ms": med["constrained"],
              "overhead": med["constrained"] / med["unconstrained"] - 1, "mask_fill_ms_per_step": mask_ms,
              "finished_in_window": sum(x["finished_in_window"] for x in runs["constrained"]),
              "compilations_after_warmup": core.runner.compilations_after_warmup, "runs": runs}
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1))
    print(f"\n| model | batch | unconstrained step ms | JSON-schema step ms | overhead | mask fill ms/step |\n"
          f"|---|---|---|---|---|---|\n| {result['model']} | {args.batch} | {med['unconstrained']:.1f} | "
          f"{med['constrained']:.1f} | {100 * result['overhead']:+.1f}% | {mask_ms:.1f} |")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
