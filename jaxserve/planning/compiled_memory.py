"""What the planner reads off compiled programs: each serving program lowered and compiled for the
target's compile-only devices (a few at once on threads), its temporaries and code size from XLA's
memory analysis, and the calibration of the roofline estimates from the compiled cost analysis."""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
import time
from collections.abc import Callable
from typing import Any

import jax

from jaxserve.core.buckets import Program, choose_bucket, declared_buckets, history_buckets, serving_programs
from jaxserve.core.config import EngineConfig, ModelConfig
from jaxserve.parallel import sharding
from jaxserve.runner.programs import lower_program

COLLECTIVE_LATENCY_S = 5e-6          # per collective on one step's critical path (assumed, PLANNING.md)
_COMPILED: dict[tuple[str, tuple], tuple[int, int, int, str]] = {}   # insertion-ordered: oldest first


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


def calibrate(programs: list[Program], model: ModelConfig, engine: EngineConfig, placement: sharding.Placement,
              dtype: Any, attention: Any, compile_layers: int | None, decode_bucket: tuple[int, int], *,
              on_start: Callable[[list[str], int], None] | None = None,
              on_program: Callable[[str, float], None] | None = None) -> Calibration:
    """Compiles `programs` (a copy of the model `compile_layers` deep: the layers are unrolled, so
    compile time grows with depth while temporaries do not) and scales what grows with depth.
    `on_start(names, depth)` hears what will compile before any of it does; `on_program(name,
    seconds)` hears each one as it finishes, from the thread that compiled it (completion order)."""
    depth = min(model.num_layers, compile_layers or model.num_layers)
    scale = model.num_layers / depth
    shallow = _with_layers(model, depth)
    # a page holds one row of every pool array, not of every layer (layer groups share arrays)
    page_scale = model.kv_groups.num_arrays / shallow.kv_groups.num_arrays
    jobs = [(p.name, functools.partial(program_memory, p, shallow, engine, placement, dtype, attention))
            for p in programs]
    if 1 < depth < model.num_layers:
        # one layer fewer tells the per-layer collectives from the rest (embedding, lm_head); it
        # needs nothing from the other compiles, so it compiles beside them
        decode = Program("forward", *decode_bucket)
        jobs.append((f"{decode.name} at {depth - 1} layer{'s' if depth > 2 else ''} (per-layer collectives)",
                     functools.partial(_compiled_memory, decode, _with_layers(model, depth - 1),
                                       dataclasses.replace(engine, num_kv_pages=64), placement, dtype, attention)))
    if on_start is not None:
        on_start([name for name, _ in jobs], depth)
    results = _map_threads(lambda job: _timed(*job, on_program), jobs)
    costs = results[:len(programs)]
    worst = max(costs, key=lambda c: c.temp_at(engine.num_kv_pages))
    notes = []
    if worst.temp_per_page > 0:
        notes.append(f"{worst.name} copies the KV pool: its temporaries grow by {worst.temp_per_page * page_scale:.0f} "
                     "bytes per page")
    colls = collectives_in(next(c.hlo for p, c in zip(programs, costs) if (p.tokens, p.rows) == decode_bucket))
    if depth < model.num_layers:
        notes.append(f"compiled {depth} of {model.num_layers} layers: KV page bytes, code and per-layer "
                     f"collectives are scaled to depth, temporaries taken as compiled (layers run in turn)")
        fewer = collectives_in(results[-1][3]) if depth > 1 else []
        colls = _extrapolate(colls, fewer, depth, model.num_layers)
    return Calibration(costs, max(c.page_bytes for c in costs) * page_scale, worst.temp_fixed,
                       worst.temp_per_page * page_scale, int(max(c.code_bytes for c in costs) * scale), colls, notes)


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


def program_memory(program: Program, model: ModelConfig, engine: EngineConfig, placement: sharding.Placement,
                   dtype: Any, attention: Any) -> ProgramMemory:
    """Compiles `program` at two small pool sizes and fits the line through the results, so a
    target's page layout (tile padding) and any copy of the pool are measured, not assumed; the
    full-size pool is never compiled (a program that copies it might not fit the device at all)."""
    p1 = max(64, engine.max_pages_per_seq)
    p2 = 2 * p1
    first = _compiled_memory(program, model, dataclasses.replace(engine, num_kv_pages=p1), placement, dtype, attention)
    if program.kind == "sample":  # no KV pages among its arguments
        return ProgramMemory(program.name, 0.0, first[1], 0.0, first[2], first[3])
    second = _compiled_memory(program, model, dataclasses.replace(engine, num_kv_pages=p2), placement, dtype,
                              attention)
    page = (second[0] - first[0]) / (p2 - p1)
    slope = max(0.0, (second[1] - first[1]) / (p2 - p1))
    if slope < page / (2 * model.kv_groups.num_arrays) / 4:
        # less than a quarter of one K (or V) array's page: no copy of the pool, but the compiler
        # placing its buffers a little differently at the two sizes (gpt-oss-20b on a v6e-4: 767
        # bytes per 16 KiB page, which read as a copy would take 1.09 GiB from a 23 GiB pool)
        return ProgramMemory(program.name, page, max(first[1], second[1]), 0.0, max(first[2], second[2]), first[3])
    return ProgramMemory(program.name, page, max(0.0, first[1] - slope * p1), slope, max(first[2], second[2]),
                         first[3])


_COMPILED_LIMIT = 32


def _compiled_memory(program: Program, model: ModelConfig, engine: EngineConfig, placement: sharding.Placement,
                     dtype: Any, attention: Any) -> tuple[int, int, int, str]:
    """(argument bytes, temp bytes, code bytes, HLO text) of one compile. Identical programs for the
    same devices compile once per process (a sweep's layouts that split the vocabulary alike share
    their sampler; plans that differ only in pool size share every program)."""
    lowered = lower_program(program, model, engine, placement, dtype, attention)
    mesh = placement.mesh
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


def _timed(name: str, compile_fn: Callable[[], Any], on_program: Callable[[str, float], None] | None) -> Any:
    """compile_fn(), and its seconds (lowering and compiling, on this thread) told to on_program."""
    start = time.perf_counter()
    out = compile_fn()
    if on_program is not None:
        on_program(name, time.perf_counter() - start)
    return out


def _map_threads(fn: Any, items: list[Any]) -> list[Any]:
    """XLA compiles outside the GIL: one thread per core."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=max(1, min(len(items), os.cpu_count() or 1))) as pool:
        return list(pool.map(fn, items))


def programs_to_compile(engine: EngineConfig, model: ModelConfig, which: str, batch: int | None) -> list[Program]:
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


_COLLECTIVE_OPS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2,
                "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}


@dataclasses.dataclass(frozen=True)
class Collective:
    kind: str
    count: int
    bytes: int          # per step, summed over the ops (result sizes on one device)


def _with_layers(cfg: ModelConfig, layers: int) -> ModelConfig:
    """The same model, `layers` deep: the first layer of each layer kind, then the first layers, in
    stack order, so a shallow copy of a mixed stack (Gemma 3: five sliding layers, then a full one)
    still has its kinds, its KV layer groups and a pool array they share."""
    if layers == cfg.num_layers:
        return cfg
    sparse = cfg.moe.layers if cfg.moe is not None else (False,) * cfg.num_layers
    firsts: dict = {}
    for i, kind in enumerate(zip(cfg.layers, sparse)):
        firsts.setdefault(kind, i)
    # attention kinds first: a hybrid stack's copy keeps a layer with K/V pages however shallow
    keep = sorted(sorted(firsts.values(), key=lambda i: (cfg.layers[i].linear, i))[:layers])
    keep = sorted(keep + [i for i in range(cfg.num_layers) if i not in keep][:layers - len(keep)])
    moe = None if cfg.moe is None else dataclasses.replace(cfg.moe, layers=tuple(sparse[i] for i in keep))
    return dataclasses.replace(cfg, num_layers=layers, layers=tuple(cfg.layers[i] for i in keep), moe=moe)


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
