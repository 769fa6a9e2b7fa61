"""`jaxserve plan`: will this model fit this target with these settings, and how fast can it go?

For one replica of a layout (layouts.py) on a target's devices (targets.py, compile-only for TPU
and GPU), the planner:
  1. sizes the engine exactly as serving would (capacity.plan_capacity, with the device memory
     from the chip table and the weights' bytes per device from `abstract(cfg)` and the rules);
  2. compiles the serving programs for the target (programs.lower_program: the forward at the
     decode buckets and the full prefill bucket, the widest sampler; `programs="all"` compiles
     every declared one), each at two small KV pool sizes, and fits the line through XLA's memory
     analysis: bytes per page as the target lays a page out, temporaries fixed and per page;
  3. reads the collectives out of the compiled HLO (kind, count, bytes per step);
  4. estimates step time with a roofline: max(FLOPs / peak, bytes / HBM bandwidth) + collective
     time (bytes over the chip's link bandwidth plus a fixed latency each).
docs/PLANNING.md says how each figure is computed and where the chip figures come from.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import time
from typing import Any

import jax
import jax.numpy as jnp

from jaxserve import capacity, sharding
from jaxserve.buckets import choose_bucket, declared_buckets, history_buckets
from jaxserve.capacity import MachineInfo, flops_per_sampled_row, flops_per_token, kv_bytes_per_token
from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.layouts import Layout, check_divides
from jaxserve.model import weights as weights_mod
from jaxserve.quant import kv as kv_quant
from jaxserve.quant.scheme import qtype_bits
from jaxserve.model.attention import make_attention
from jaxserve.model.kv_heads import duplicated_config, kv_duplication
from jaxserve.buckets import Program, serving_programs
from jaxserve.programs import lower_program
from jaxserve.targets import Target

DECODE_BATCHES = (1, 8, 64)          # plus max_num_seqs
SWEEP_COMPILE_LAYERS = 2             # --sweep compiles this many layers of each layout (then scales)
COLLECTIVE_LATENCY_S = 5e-6          # per collective on one step's critical path (assumed, PLANNING.md)
_COLLECTIVE_OPS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2,
                "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}


@dataclasses.dataclass(frozen=True)
class Collective:
    kind: str
    count: int
    bytes: int          # per step, summed over the ops (result sizes on one device)


@dataclasses.dataclass(frozen=True)
class StepEstimate:
    what: str           # "decode b=8" | "prefill T=2048"
    batch: int          # sequences (decode) or tokens (prefill)
    bucket: str         # the compiled program that serves it
    flops: float        # per device
    bytes: float        # HBM bytes read/written per device
    collective_bytes: int
    collectives: int
    seconds: float      # roofline estimate
    bound: str          # "compute" | "memory" | "collectives"
    tokens_per_s: float  # per replica


@dataclasses.dataclass(frozen=True)
class DevicePlan:
    target: str
    device_kind: str
    layout: str
    tp: int                             # devices per replica
    replicas: int                       # replicas on the target
    dtype: str
    settings: dict[str, Any]            # the resolved engine sizes
    hbm_bytes: int
    usable_bytes: int                   # hbm x memory_utilization
    weight_bytes: int                   # per device
    kv_pool_bytes: int                  # per device
    temp_bytes: int                     # compiled temporaries of the largest program, per device
    code_bytes: int                     # compiled program code, largest program
    total_bytes: int
    fits: bool
    headroom_bytes: int                 # usable - total (negative: short by that much)
    max_kv_pool_bytes: int              # the largest pool that fits beside weights and temporaries
    max_kv_tokens: int
    max_seqs_at_max_len: int
    programs_compiled: int
    compile_seconds: float
    program_temps: dict[str, int]       # compiled program -> its temporaries at this pool, per device
    collectives: list[Collective]       # of the decode program at `batch` (default max_num_seqs)
    steps: list[StepEstimate]
    notes: list[str]
    advice: list[str]                   # settings that would make a non-fitting plan fit

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _with_layers(cfg: ModelConfig, layers: int) -> ModelConfig:
    """The same model, `layers` deep (the first layers' attention windows)."""
    if layers == cfg.num_layers:
        return cfg
    return dataclasses.replace(cfg, num_layers=layers, layer_windows=cfg.layer_windows[:layers])


def weight_bytes_per_device(cfg: ModelConfig, dtype: Any, mesh: jax.sharding.Mesh, rules: sharding.Rules) -> int:
    """Bytes of the weight shards one device holds (from the declaration and the rules)."""
    specs = weights_mod.abstract(cfg, dtype)
    shards = weights_mod.shardings(specs, cfg, mesh, rules)
    total = 0
    for spec, shard in zip(jax.tree.leaves(specs, is_leaf=weights_mod.is_spec), jax.tree.leaves(shards)):
        total += math.prod(shard.shard_shape(spec.shape)) * qtype_bits(spec.dtype) // 8  # int4 packs two a byte
    return total


def collectives_in(hlo_text: str) -> list[Collective]:
    """Collective ops of a compiled HLO module: kind, count and bytes of their results (async
    pairs are counted once, at their -start op)."""
    counts: dict[str, list[int]] = {}
    pattern = re.compile(r"=\s*(\(?[^=]*?\)?)\s+(" + "|".join(_COLLECTIVE_OPS) + r")(-start)?\(")
    for line in hlo_text.splitlines():
        m = pattern.search(line)
        if m is None:
            continue
        shapes = re.findall(r"([a-z0-9]+)\[([0-9,]*)\]", m.group(1))
        size = 0
        for dt, dims in shapes:
            size += _DTYPE_BYTES.get(dt, 4) * math.prod(int(d) for d in dims.split(",") if d)
        if m.group(3) and len(shapes) > 1:  # async start ops return (operand, result[, ...]): count the result
            dt, dims = shapes[1]
            size = _DTYPE_BYTES.get(dt, 4) * math.prod(int(d) for d in dims.split(",") if d)
        counts.setdefault(m.group(2), []).append(size)
    return [Collective(k, len(v), sum(v)) for k, v in sorted(counts.items())]


def _extrapolate(at_depth: list[Collective], one_less: list[Collective], depth: int, layers: int
                 ) -> list[Collective]:
    """Collectives of a `layers`-deep model from those at `depth` and `depth - 1` layers."""
    less = {c.kind: c for c in one_less}
    out = []
    for c in at_depth:
        o = less.get(c.kind, Collective(c.kind, 0, 0))
        per_count, per_bytes = c.count - o.count, c.bytes - o.bytes
        out.append(Collective(c.kind, c.count + per_count * (layers - depth), c.bytes + per_bytes * (layers - depth)))
    return out


def collective_seconds(colls: list[Collective], n: int, link_bandwidth: float) -> float:
    """Ring algorithms over n devices: an all-reduce moves 2(n-1)/n of its bytes per device, a
    gather/scatter (n-1)/n; plus a fixed latency per op."""
    if n <= 1 or not colls:
        return 0.0
    seconds = 0.0
    for c in colls:
        factor = 2 * (n - 1) / n if c.kind == "all-reduce" else (n - 1) / n
        seconds += c.count * COLLECTIVE_LATENCY_S + (factor * c.bytes / link_bandwidth if link_bandwidth else 0.0)
    return seconds


def _attention_flops(cfg: ModelConfig, q_tokens: int, context: int) -> float:
    """QK^T and PV of q_tokens queries over `context` keys, all layers (per replica)."""
    return 4.0 * q_tokens * context * cfg.head_dim * cfg.num_heads * cfg.num_layers


def _machine(target: Target, mesh: jax.sharding.Mesh, weight_bytes: int) -> MachineInfo:
    chip = target.chip
    if chip.platform == "cpu":
        from jaxserve.machine import machine_info
        here = machine_info(mesh)
        # serving reads MemAvailable after loading the weights: they are no longer available then
        return dataclasses.replace(here, memory_per_device=max(0, here.memory_per_device - weight_bytes))
    return MachineInfo(chip.platform, chip.device_kind, chip.hbm_bytes, weight_bytes, 1)


def plan_deployment(model: ModelConfig, target: Target, layout: Layout, engine: EngineConfig, dtype: Any,
                    *, context: int | None = None, programs: str = "serving", batch: int | None = None,
                    compile_programs: bool = True, compile_layers: int | None = None) -> DevicePlan:
    """The plan of one replica (see the module docstring). `context`: the tokens each decoding
    sequence has in cache for the step estimates (default: max_model_len); `programs`: which
    programs to compile ("serving" or "all"; see _programs_to_compile); `compile_layers`: compile
    a copy of the model this deep (faster; what scales with depth is scaled back)."""
    dtype = jnp.dtype(dtype)
    notes = check_divides(layout, model)
    rules = layout.rules
    model = duplicated_config(model, kv_duplication(model, layout.tp, rules))  # as the runner does
    devices = target.devices()[: layout.tp]
    mesh = sharding.make_mesh(1, layout.tp, devices)
    weight_bytes = weight_bytes_per_device(model, dtype, mesh, rules)
    machine = _machine(target, mesh, weight_bytes)
    chip = target.chip
    utilization = engine.memory_utilization or capacity.DEFAULT_MEMORY_UTILIZATION[chip.platform]
    usable = int(utilization * chip.hbm_bytes)
    model_axis_kv = layout.tp if dict(rules).get("kv_heads") == sharding.MODEL_AXIS else 1
    per_token = kv_bytes_per_token(model, dtype.itemsize, model_axis_kv, engine.kv_cache_dtype)
    advice: list[str] = []
    sized_from_memory = engine.num_kv_pages is None and engine.kv_cache_memory is None
    try:
        cap = capacity.plan_capacity(engine, model, machine, dtype.itemsize, model_axis_kv)
        resolved, pool_bytes, est_temp = cap.engine, cap.kv_pool_bytes, cap.temp_bytes
    except ValueError as e:
        # Nothing fits: plan the smallest engine that could run (one full-length sequence), so the
        # programs still compile and the report says by how much it is short.
        notes.append(str(e))
        max_len = engine.max_model_len or capacity.model_context(model)
        pages = -(-max_len // engine.page_size)
        resolved = capacity.plan_capacity(
            dataclasses.replace(engine, num_kv_pages=pages, kv_cache_memory=None), model, machine,
            dtype.itemsize, model_axis_kv).engine
        pool_bytes, est_temp, sized_from_memory = pages * engine.page_size * per_token, 0, False

    to_compile = _programs_to_compile(resolved, model, programs, batch)
    attention = make_attention(resolved.attention_backend, model, mesh, rules)
    b = min(batch or resolved.max_num_seqs, resolved.max_num_seqs)
    decode_bucket = choose_bucket(declared_buckets(resolved), b, b)  # its collectives are reported
    page_bytes, fixed, slope, code, colls, compile_s, program_temps = (
        per_token * resolved.page_size, est_temp, 0.0, 0, [], 0.0, {})
    compiled_ok = False
    if compile_programs:
        start = time.perf_counter()
        try:
            cal = _calibrate(to_compile, model, resolved, mesh, dtype, attention, rules, compile_layers, decode_bucket)
            compiled_ok = True
        except ValueError as e:  # a program that does not fit the device even with a tiny pool
            notes.append(str(e))
        compile_s = time.perf_counter() - start
    if compiled_ok:
        fixed, slope, code, colls = cal.temp_fixed, cal.temp_per_page, cal.code, cal.colls
        page_bytes = cal.page_bytes or page_bytes  # a target that reports no argument sizes: logical bytes
        notes += cal.notes
        if page_bytes > per_token * resolved.page_size * 1.01:
            notes.append(f"a KV page takes {page_bytes / (per_token * resolved.page_size):.2f}x its logical bytes on "
                         f"{chip.device_kind} (tile padding of the [page, kv_heads, head_dim] minor dims)")
        if sized_from_memory:  # the pool serving would take, with pages as the target lays them out
            room = usable - weight_bytes - code - fixed
            pages = capacity.stable_page_count(max(0, int(room // (page_bytes + slope))))
            resolved = dataclasses.replace(resolved, num_kv_pages=max(1, min(resolved.num_kv_pages, pages)))
        pool_bytes = int(resolved.num_kv_pages * page_bytes)
        program_temps = {c.name: int(c.temp_at(resolved.num_kv_pages)) for c in cal.costs}
    # the pool that fits: pages x (page + per-page temporaries) + fixed costs <= usable
    temp = int(fixed + slope * resolved.num_kv_pages)
    total = weight_bytes + pool_bytes + temp + code
    max_pages = max(0, int((usable - weight_bytes - code - fixed) // (page_bytes + slope)))
    max_pool = int(max_pages * page_bytes)
    max_tokens = max_pages * resolved.page_size
    steps = _step_estimates(model, chip, layout, resolved, dtype, weight_bytes, per_token, colls, decode_bucket[0],
                            context or resolved.max_model_len, resolved.num_kv_pages * resolved.page_size, batch)
    fits = total <= usable and (compiled_ok or not compile_programs)
    if not fits:
        advice = _advice(model, target, layout, resolved, dtype, weight_bytes, temp + code, per_token, usable)
    settings = {k: getattr(resolved, k) for k in ("max_num_seqs", "max_num_batched_tokens", "max_model_len",
                                                  "page_size", "num_kv_pages", "memory_utilization",
                                                  "kv_cache_dtype")}
    settings["token_buckets"] = list(resolved.resolved_token_buckets())
    settings["seq_buckets"] = list(resolved.resolved_seq_buckets())
    return DevicePlan(
        target=target.name, device_kind=chip.device_kind, layout=layout.name, tp=layout.tp,
        replicas=layout.replicas, dtype=dtype.name, settings=settings,
        hbm_bytes=chip.hbm_bytes, usable_bytes=usable, weight_bytes=weight_bytes, kv_pool_bytes=pool_bytes,
        temp_bytes=temp, code_bytes=code, total_bytes=total, fits=fits, headroom_bytes=usable - total,
        max_kv_pool_bytes=max_pool, max_kv_tokens=int(max_tokens),
        max_seqs_at_max_len=int(max_tokens // resolved.max_model_len),
        programs_compiled=len(to_compile) if compile_programs else 0, compile_seconds=compile_s,
        program_temps=program_temps,
        collectives=colls, steps=steps, notes=notes, advice=advice)


@dataclasses.dataclass(frozen=True)
class Calibration:
    """What compiling the programs for the target measured, scaled to the model's depth."""

    costs: list["ProgramMemory"]
    page_bytes: float          # one KV page as the target lays it out
    temp_fixed: float          # the costliest program's temporaries at zero pages...
    temp_per_page: float       # ...and per page of pool
    code: int
    colls: list[Collective]    # of the decode program
    notes: list[str]


def _calibrate(programs: list[Program], model: ModelConfig, engine: EngineConfig, mesh: jax.sharding.Mesh,
               dtype: Any, attention: Any, rules: sharding.Rules, compile_layers: int | None,
               decode_bucket: tuple[int, int]) -> Calibration:
    """Compiles `programs` (a copy of the model `compile_layers` deep: the layers are unrolled, so
    compile time grows with depth while temporaries do not) and scales what grows with depth."""
    depth = min(model.num_layers, compile_layers or model.num_layers)
    scale = model.num_layers / depth
    shallow = _with_layers(model, depth)
    costs = _map_threads(lambda p: program_memory(p, shallow, engine, mesh, dtype, attention, rules), programs)
    worst = max(costs, key=lambda c: c.temp_at(engine.num_kv_pages))
    notes = []
    if worst.temp_per_page > 0:
        notes.append(f"{worst.name} copies the KV pool: its temporaries grow by {worst.temp_per_page * scale:.0f} "
                     "bytes per page")
    colls = collectives_in(next(c.hlo for p, c in zip(programs, costs) if (p.tokens, p.rows) == decode_bucket))
    if depth < model.num_layers:
        notes.append(f"compiled {depth} of {model.num_layers} layers: KV page bytes, code and per-layer "
                     f"collectives are scaled to depth, temporaries taken as compiled (layers run in turn)")
        # one layer fewer tells the per-layer collectives from the rest (embedding, lm_head)
        fewer = collectives_in(_compiled_memory(Program("forward", *decode_bucket), _with_layers(model, depth - 1),
                                                dataclasses.replace(engine, num_kv_pages=64), mesh, dtype,
                                                attention, rules)[3]) if depth > 1 else []
        colls = _extrapolate(colls, fewer, depth, model.num_layers)
    return Calibration(costs, max(c.page_bytes for c in costs) * scale, worst.temp_fixed,
                       worst.temp_per_page * scale, int(max(c.code_bytes for c in costs) * scale), colls, notes)


@dataclasses.dataclass(frozen=True)
class ProgramMemory:
    """A program's device memory as a function of the KV pool's page count (from two compiles)."""

    name: str
    page_bytes: float      # argument bytes per KV page (K and V, all layers, as laid out on the target)
    temp_fixed: float      # temporaries at zero pages
    temp_per_page: float   # temporaries that scale with the pool (a copy of it)
    code_bytes: int
    hlo: str               # the compiled HLO (first compile)

    def temp_at(self, pages: int) -> float:
        return self.temp_fixed + self.temp_per_page * pages


def program_memory(program: Program, model: ModelConfig, engine: EngineConfig, mesh: jax.sharding.Mesh,
                   dtype: Any, attention: Any, rules: sharding.Rules) -> ProgramMemory:
    """Compiles `program` at two small pool sizes and fits the line through the results, so a
    target's page layout (tile padding) and any copy of the pool are measured, not assumed; the
    full-size pool is never compiled (a program that copies it might not fit the device at all)."""
    p1 = max(64, engine.max_pages_per_seq)
    p2 = 2 * p1
    first = _compiled_memory(program, model, dataclasses.replace(engine, num_kv_pages=p1), mesh, dtype, attention,
                             rules)
    if program.kind == "sample":  # no KV pages among its arguments
        return ProgramMemory(program.name, 0.0, first[1], 0.0, first[2], first[3])
    second = _compiled_memory(program, model, dataclasses.replace(engine, num_kv_pages=p2), mesh, dtype,
                              attention, rules)
    page = (second[0] - first[0]) / (p2 - p1)
    slope = max(0.0, (second[1] - first[1]) / (p2 - p1))
    return ProgramMemory(program.name, page, max(0.0, first[1] - slope * p1), slope, max(first[2], second[2]),
                         first[3])


_COMPILED: dict[tuple[str, tuple], tuple[int, int, int, str]] = {}   # insertion-ordered: oldest first
_COMPILED_LIMIT = 32


def _compiled_memory(program: Program, model: ModelConfig, engine: EngineConfig, mesh: jax.sharding.Mesh,
                     dtype: Any, attention: Any, rules: sharding.Rules) -> tuple[int, int, int, str]:
    """(argument bytes, temp bytes, code bytes, HLO text) of one compile. Identical programs for the
    same devices compile once per process (a sweep's layouts that split the vocabulary alike share
    their sampler; plans that differ only in pool size share every program)."""
    lowered = lower_program(program, model, engine, mesh, dtype, attention, rules)
    key = (lowered.as_text(), tuple((d.device_kind, d.id) for d in mesh.devices.flat))
    if key not in _COMPILED:
        _COMPILED[key] = _compile_memory(lowered, program, engine, mesh)
        while len(_COMPILED) > _COMPILED_LIMIT:
            _COMPILED.pop(next(iter(_COMPILED)))
    return _COMPILED[key]


def _compile_memory(lowered: jax.stages.Lowered, program: Program, engine: EngineConfig,
                    mesh: jax.sharding.Mesh) -> tuple[int, int, int, str]:
    try:
        compiled = lowered.compile()
    except Exception as e:  # XLA refuses a program that cannot fit the device even with a tiny pool
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        raise ValueError(f"{program.name} does not fit {mesh.devices.flat[0].device_kind} even with a "
                         f"{engine.num_kv_pages}-page KV pool: {str(e).splitlines()[0]}") from None
    mem = compiled.memory_analysis()
    if mem is None:
        return 0, 0, 0, compiled.as_text()
    return (int(mem.argument_size_in_bytes), int(mem.temp_size_in_bytes), int(mem.generated_code_size_in_bytes),
            compiled.as_text())


def _map_threads(fn: Any, items: list[Any]) -> list[Any]:
    """XLA compiles outside the GIL: one thread per core."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=max(1, min(len(items), os.cpu_count() or 1))) as pool:
        return list(pool.map(fn, items))


def _programs_to_compile(engine: EngineConfig, model: ModelConfig, which: str, batch: int | None) -> list[Program]:
    """"all": every declared program; "serving": the decode bucket at `batch` (default
    max_num_seqs; its collectives are reported), the largest step (the most temporaries) and the
    widest sampler."""
    if which == "all":
        return serving_programs(engine, model)
    buckets = declared_buckets(engine)
    b = min(batch or engine.max_num_seqs, engine.max_num_seqs)
    rows = max(s for _, s in buckets)
    widest = max(history_buckets(engine.max_model_len, model.vocab_size))
    return ([Program("forward", t, s) for t, s in sorted({choose_bucket(buckets, b, b), max(buckets)})]
            + [Program("sample", rows=rows, history=widest)])


def _step_estimates(cfg: ModelConfig, chip: Any, layout: Layout, engine: EngineConfig, dtype: Any,
                    weight_bytes: int, kv_per_token: int, colls: list[Collective], colls_tokens: int,
                    context: int, pool_tokens: int, batch: int | None = None) -> list[StepEstimate]:
    """Roofline per device of one replica. Decode (at the batches whose sequences' `context` tokens
    the pool holds): every weight byte is read once per step, plus each sequence's KV; prefill:
    one full bucket of prompt tokens attending to themselves. `colls` were read off the program of
    `colls_tokens` token rows; other buckets move the same collectives over their own rows."""
    tp, peak, bw = layout.tp, chip.flops(dtype.name), chip.hbm_bandwidth
    buckets = declared_buckets(engine)

    def estimate(what: str, n: int, t: int, s: int, flops: float, data: float) -> StepEstimate:
        scaled = [Collective(c.kind, c.count, c.bytes * t // max(1, colls_tokens)) for c in colls]
        colls_s = collective_seconds(scaled, tp, chip.link_bandwidth)
        compute_s, memory_s = flops / peak, data / bw
        seconds = max(compute_s, memory_s) + colls_s
        bound = ("collectives" if colls_s > max(compute_s, memory_s)
                 else "compute" if compute_s >= memory_s else "memory")
        return StepEstimate(what, n, f"T={t} S={s}", flops, data, sum(c.bytes for c in scaled),
                            sum(c.count for c in scaled), seconds, bound, n / seconds)

    out = []
    fit = min(engine.max_num_seqs, max(1, pool_tokens // context))  # sequences of `context` the pool holds
    for b in sorted({b for b in (*DECODE_BATCHES, engine.max_num_seqs, batch or 1) if b <= fit} | {fit}):
        t, s = choose_bucket(buckets, b, b)
        flops = (t * flops_per_token(cfg) + _attention_flops(cfg, b, context) + s * flops_per_sampled_row(cfg)) / tp
        out.append(estimate(f"decode b={b}", b, t, s, flops, weight_bytes + b * (context + 1) * kv_per_token))
    n = engine.max_num_batched_tokens
    t, s = choose_bucket(buckets, n, 1)
    flops = (t * flops_per_token(cfg) + _attention_flops(cfg, n, n) / 2 + s * flops_per_sampled_row(cfg)) / tp
    activations = 2 * n * cfg.hidden_size * dtype.itemsize * cfg.num_layers
    out.append(estimate(f"prefill T={n}", n, t, s, flops, weight_bytes + n * kv_per_token + activations))
    return out


def _advice(model: ModelConfig, target: Target, layout: Layout, engine: EngineConfig, dtype: Any,
            weight_bytes: int, fixed_bytes: int, per_token: int, usable: int) -> list[str]:
    """What would make a plan fit: a pool that fits, more devices per replica, a shorter context."""
    out = []
    short = weight_bytes + fixed_bytes + per_token * engine.max_model_len - usable
    one_seq = -(-engine.max_model_len // engine.page_size) * engine.page_size * per_token
    if weight_bytes + fixed_bytes + one_seq <= usable:
        fit_pool = usable - weight_bytes - fixed_bytes
        out.append(f"--kv-cache-memory {fit_pool // 2**20}MiB (or leave it unset): the pool that fits holds "
                   f"{fit_pool // per_token} tokens")
    if not kv_quant.is_quantized(engine.kv_cache_dtype):
        out.append(f"--kv-cache-dtype int8 (or fp8): {kv_quant.describe('int8', model.head_dim, dtype.itemsize)}")
    else:
        out.append(f"one {engine.max_model_len}-token sequence does not fit: short by {human_bytes(short)} per device")
        room = usable - weight_bytes - fixed_bytes
        if room > per_token * engine.page_size:
            out.append(f"--max-model-len {room // per_token // engine.page_size * engine.page_size} fits the "
                       "memory left after weights and temporaries")
    n = target.num_devices
    for tp in range(layout.tp + 1, n + 1):
        if n % tp == 0 and model.num_heads % tp == 0:
            scaled = weight_bytes * layout.tp / tp  # weights split further (an upper bound: replicated leaves stay)
            if scaled + fixed_bytes + one_seq * layout.tp / tp <= usable:
                out.append(f"tensor parallelism {tp} (weights ~{human_bytes(int(scaled))} per device)")
                break
    else:
        if dtype.itemsize > 1:
            out.append(f"a larger slice: the weights alone take {human_bytes(weight_bytes * layout.tp)} "
                       f"across {layout.tp} devices of {human_bytes(usable)} usable each")
    return out


def human_bytes(n: float) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def sweep(model: ModelConfig, target: Target, engine: EngineConfig, dtype: Any, *, batch: int,
          context: int, compile_layers: int | None = SWEEP_COMPILE_LAYERS) -> list[DevicePlan]:
    """Every candidate layout (layouts.candidate_layouts) planned at `batch` sequences of
    `context` tokens, best decode tokens/s per chip first (fitting layouts before the rest)."""
    from jaxserve.layouts import candidate_layouts

    plans = []
    for layout in candidate_layouts(model, target.num_devices):
        eng = dataclasses.replace(engine, max_num_seqs=engine.max_num_seqs or batch)
        plans.append(plan_deployment(model, target, layout, eng, dtype, context=context, batch=batch,
                                     compile_layers=compile_layers))
    return sorted(plans, key=lambda p: (not p.fits, -decode_tokens_per_chip(p, batch)))


def decode_step(plan: DevicePlan, batch: int) -> StepEstimate:
    """The decode estimate at `batch` sequences, or the largest batch below it the pool holds."""
    decodes = [s for s in plan.steps if s.what.startswith("decode")]
    return max((s for s in decodes if s.batch <= batch), key=lambda s: s.batch, default=decodes[0])


def decode_tokens_per_chip(plan: DevicePlan, batch: int) -> float:
    """Estimated decode tokens/s per device at `batch` sequences per replica (or fewer: decode_step)."""
    return decode_step(plan, batch).tokens_per_s / plan.tp
