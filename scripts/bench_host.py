"""The host's share of a step: everything but the device's own work, per step, by stage.

    python scripts/bench_host.py                                   # 64 / 256 / 1024 rows, context 128
    python scripts/bench_host.py --rows 256 --contexts 128,8192    # does it grow with history?
    python scripts/bench_host.py --modes sampling,greedy,ngram

A micro model (Qwen3 architecture, hidden 64, one layer, a 512-token vocabulary) makes the device's
work negligible, so a step's wall time is mostly the host's. The engine (EngineCore, the defaults:
async scheduling on) holds `rows` running requests, each decoding; after they are all prefilled,
`--steps` decode steps are timed, `--repeats` times (the median is reported). Per step:

- wall: the step loop's time per step (EngineCore.step, events returned);
- dispatch: time inside the runtime (handing the step's arrays and programs to it, and waiting for
  the sampled ids; on XLA:CPU the device work runs inside these calls);
- host: wall - dispatch, everything the engine thread does besides: its stages from
  EngineCore.timings are schedule (scheduler), build (step inputs and sampling tensors), mask
  (grammar bitmasks), update (sampled ids applied, stop checks, events), and the rest (the step
  loop's own bookkeeping, garbage collection);
- device: the step's programs replayed alone on one captured step (forward + sampler run to
  completion, packing and transfer of its inputs included), for scale.

`--fake-device-ms D` replaces the device with one that takes exactly D ms per step (steps run in
order; the sampled ids are ready D ms after the later of the step's dispatch and the previous
step's completion; nothing is compiled). D = 0: wall is the host's time alone, the cleanest figure
on a CPU, where the real device's work shares the cores with the host thread. D > 0: whether the
host prepares step n+1 while step n runs shows as wall ~ max(host, D) per step, against host + D
when each step waits for the previous one (speculation: a proposal needs the last token).

Modes: `sampling` (temperature 0.8, top-p 0.9, presence and frequency penalties 0.5, 2 logprobs, a
seed per request), `greedy` (temperature 0), `ngram` (sampling plus n-gram speculation, 3 drafts),
`structured` (sampling, every request constrained by a JSON schema through llguidance and the real
Qwen tokenizer of the embedded model, so the micro model takes its 151,936-token vocabulary: run it
with --fake-device-ms, whose device samples each row's first allowed token).
`--clock cpu` reports the engine thread's CPU time instead of wall time (with the stand-in device
the engine thread is the only one working): on a shared machine other processes stretch wall time
by up to 2x, CPU time much less.
Contexts: every request's prompt is `context` tokens, all but the last 16 shared (prefix caching on,
so 8k-token histories cost one prefill); the page tables and penalty histories are those of the full
context either way. Every run has the same max_model_len (--max-model-len, 8192 by default, plus the
outputs), so the step's [S, max_pages_per_seq] page-table array is as wide whatever the context.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import bench_common as bc  # noqa: E402

MICRO = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=64, intermediate_size=128,
             num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=32, vocab_size=512,
             max_position_embeddings=16384, tie_word_embeddings=True, rms_norm_eps=1e-6, rope_theta=1e6,
             dtype="float32")
UNIQUE = 16  # prompt tokens of each request after the shared prefix


SCHEMA = {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "integer"}}},
          "required": ["items"], "additionalProperties": False}


def sampling_params(mode: str, i: int, max_tokens: int):
    from jaxserve.core.sampling_params import SamplingParams
    from jaxserve.structured import StructuredOutputs

    if mode == "greedy":
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    structured = StructuredOutputs(json=SCHEMA) if mode == "structured" else None
    return SamplingParams(temperature=0.8, top_p=0.9, presence_penalty=0.5, frequency_penalty=0.5, logprobs=2,
                          seed=1000 + i, max_tokens=max_tokens, ignore_eos=True, structured_outputs=structured)


def grammar_for(mode: str):
    """The compiled grammar structured requests carry (None in the other modes)."""
    if mode != "structured":
        return None
    from jaxserve.default_model import CONFIG, ensure_default_model
    from jaxserve.structured import GrammarCompiler, StructuredOutputs
    from jaxserve.text.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(ensure_default_model())
    return GrammarCompiler(tok.hf, CONFIG["vocab_size"], tok.eos_token_ids).compile(StructuredOutputs(json=SCHEMA))


def make_core(rows: int, context: int, steps: int, mode: str, max_model_len: int = 8192):
    import jax.numpy as jnp

    from jaxserve.core.config import EngineConfig, ModelConfig, SpeculativeConfig
    from jaxserve.engine.engine_core import EngineCore
    from jaxserve.model.weights import init_random
    from jaxserve.parallel.sharding import make_mesh

    if mode == "structured":
        from jaxserve.default_model import CONFIG

        model_cfg = ModelConfig.from_hf({**MICRO, "vocab_size": CONFIG["vocab_size"]})
    else:
        model_cfg = ModelConfig.from_hf(MICRO)
    weights = init_random(model_cfg, seed=0, dtype=jnp.float32)
    page_size = 16
    max_len = max(context, max_model_len) + steps + 64  # one config for every context: the same page-table width
    per_row = -(-(UNIQUE + steps + 64) // page_size) + 1  # beyond the shared prefix
    pages = -(-max_len // page_size) + rows * per_row + 16
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=3) if mode == "ngram" else None
    ecfg = EngineConfig(page_size=page_size, num_kv_pages=pages, max_num_seqs=rows,
                        max_num_batched_tokens=max(rows * 4, 512), max_model_len=max_len,
                        enable_prefix_caching=True, speculative_config=spec)
    return EngineCore(model_cfg, weights, ecfg, make_mesh(1, 1))


class FakeDevice:
    """Stands in for the runner's forward / sample / fetch: each step takes `ms`, in order."""

    def __init__(self, ms: float) -> None:
        self.seconds = ms / 1e3
        self.free_at = 0.0

    def install(self, runner) -> None:
        runner.forward = lambda inputs: inputs
        runner.sample = self.sample
        runner.fetch = self.fetch

    def sample(self, logits, inputs, bitmask=None):
        import numpy as np

        self.free_at = max(time.perf_counter(), self.free_at) + self.seconds
        rows = inputs.sampling.num_rows
        ids = np.full(rows, 7, np.int32)
        if bitmask is not None:  # each constrained row's first allowed token
            bits = np.unpackbits(bitmask[:rows].view(np.uint8), axis=1, bitorder="little")
            allowed = inputs.sampling.constrained[:rows]
            ids[allowed] = bits[allowed].argmax(axis=1)
        return self.free_at, ids

    def fetch(self, handle):
        import numpy as np

        from jaxserve.runner.sampler import SamplerOutput

        ready, ids = handle
        if (wait := ready - time.perf_counter()) > 0:
            time.sleep(wait)
        rows = len(ids)
        return SamplerOutput(ids, np.zeros(rows, np.float32), np.full((rows, 20), 7, np.int32),
                             np.zeros((rows, 20), np.float32))


def device_ms(core, repeats: int = 7) -> float:
    """Median milliseconds of one captured decode step's programs (forward + sampler + fetch)."""
    import jax

    from bench_engine import capture_step_inputs

    runner = core.runner
    inputs = capture_step_inputs(core)
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        logits, runner.kv = runner._forward(inputs.arrays)
        jax.block_until_ready(runner.sample(logits, inputs, None))
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:]) * 1e3


@contextlib.contextmanager
def engine_clock(clock: str):
    """The clock EngineCore's stage timings and the timed loop read: wall (perf_counter) or the
    calling thread's CPU time (thread_time), swapped into engine_core for the run only."""
    from jaxserve.engine import engine_core

    read = time.thread_time if clock == "cpu" else time.perf_counter
    saved = engine_core.time
    engine_core.time = types.SimpleNamespace(perf_counter=read, monotonic=time.monotonic)
    try:
        yield read
    finally:
        engine_core.time = saved


def run(rows: int, context: int, mode: str, steps: int, repeats: int, fake_device_ms: float | None = None,
        max_model_len: int = 8192, clock: str = "wall") -> dict:
    from jaxserve.core.request import Request
    try:
        from jaxserve.engine.loading import freeze_startup_heap
    except ImportError:  # a revision from before the heap freeze (before/after runs)
        def freeze_startup_heap() -> None:
            pass

    # enough for every timed step; a speculating step may emit 1 + 3 tokens
    max_tokens = (steps * (repeats + 2) + 32) * (4 if mode == "ngram" else 1)
    core = make_core(rows, context, max_tokens, mode, max_model_len)
    grammar = grammar_for(mode)
    t0 = time.perf_counter()
    if fake_device_ms is None:  # the stand-in device runs no program
        core.runner.warmup()
    warm = time.perf_counter() - t0
    freeze_startup_heap()  # what every entry point does once loaded (engine/loading.py)
    if fake_device_ms is not None:
        FakeDevice(fake_device_ms).install(core.runner)
    shared = [(13 * j) % 500 + 1 for j in range(context - UNIQUE)]
    core.add_request(Request("r0", shared + [(j * 7) % 500 + 1 for j in range(UNIQUE)],
                             sampling_params(mode, 0, max_tokens), grammar=grammar))
    while not any(e.request_id == "r0" for e in core.step()):  # the shared prefix enters the cache
        pass
    for i in range(1, rows):
        core.add_request(Request(f"r{i}", shared + [(i * 31 + j * 7) % 500 + 1 for j in range(UNIQUE)],
                                 sampling_params(mode, i, max_tokens), grammar=grammar))
    started: set[str] = {"r0"}
    while len(started) < rows:
        started.update(e.request_id for e in core.step())
    for _ in range(4):
        core.step()
    walls, stages = [], []
    with engine_clock(clock) as now:
        for _ in range(repeats):
            core.timings.__init__()
            t0 = now()
            for _ in range(steps):
                core.step()
            walls.append((now() - t0) / steps * 1e3)
            tm = core.timings
            stages.append({k: getattr(tm, k) / steps * 1e3 for k in ("schedule", "build", "mask", "device", "update")})
    dev = device_ms(core) if fake_device_ms is None else fake_device_ms
    wall = statistics.median(walls)
    stage = {k: round(statistics.median(s[k] for s in stages), 3) for k in stages[0]}
    stage["dispatch"] = stage.pop("device")  # dispatch + waiting for the step's ids
    return {"rows": rows, "context": context, "mode": mode, "wall_ms": round(wall, 3), "device_ms": round(dev, 3),
            "host_ms": round(wall - stage["dispatch"], 3), "stages_ms": stage, "sync_steps": core.num_sync_steps,
            "recompiles": core.runner.compilations_after_warmup, "warmup_s": round(warm, 1), "clock": clock}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="64,256,1024", help="running requests, comma-separated")
    ap.add_argument("--contexts", default="128", help="prompt tokens per request, comma-separated")
    ap.add_argument("--modes", default="sampling", help="sampling, greedy, ngram; comma-separated")
    ap.add_argument("--steps", type=int, default=16, help="decode steps per timed repeat")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--max-model-len", type=int, default=8192, help="context limit of every run (plus the outputs)")
    ap.add_argument("--fake-device-ms", type=float, default=None,
                    help="a stand-in device taking this many ms per step (see above)")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="cpu: every figure is the engine thread's CPU time (time.thread_time) instead of "
                         "wall time; for a shared machine, where other processes stretch wall time. Needs "
                         "--fake-device-ms (the real device's work runs on other threads)")
    ap.add_argument("--json-out", help="write the rows as JSON here")
    a = ap.parse_args(argv)
    if a.clock == "cpu" and a.fake_device_ms is None:
        ap.error("--clock cpu needs --fake-device-ms: the device's own work runs on XLA's threads")
    out = []
    for mode in a.modes.split(","):
        for context in map(int, a.contexts.split(",")):
            for rows in map(int, a.rows.split(",")):
                r = run(rows, context, mode, a.steps, a.repeats, a.fake_device_ms, a.max_model_len, a.clock)
                out.append(r)
                print(json.dumps(r), flush=True)
    info = bc.machine_info()
    print(f"CPU {info.get('cpu')} | jax {info.get('jax')} | clock {a.clock}")
    print("| mode | rows | context | wall ms/step | dispatch | host | schedule | build | mask | update | rest "
          "| device alone |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in out:
        s = r["stages_ms"]
        rest = r["host_ms"] - s["schedule"] - s["build"] - s["mask"] - s["update"]
        print(f"| {r['mode']} | {r['rows']} | {r['context']} | {r['wall_ms']:.2f} | {s['dispatch']:.2f} | "
              f"**{r['host_ms']:.2f}** | {s['schedule']:.2f} | {s['build']:.2f} | {s['mask']:.2f} | {s['update']:.2f} | "
              f"{rest:.2f} | {r['device_ms']:.2f} |")
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
