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
import time
from typing import Any, Protocol

import jax
import jax.numpy as jnp

from jaxserve.core import capacity
from jaxserve.core.buckets import choose_bucket, declared_buckets
from jaxserve.core.capacity import (MachineInfo, flops_per_sampled_row, flops_per_token, kv_bytes_per_token,
                                    linear_state_bytes)
from jaxserve.core.config import EngineConfig, ModelConfig
from jaxserve.model.attention import make_attention
from jaxserve.parallel import sharding
from jaxserve.parallel.kv_heads import duplicated_config, kv_duplication
from jaxserve.parallel.layouts import Layout, check_divides
from jaxserve.planning.compiled_memory import Collective, calibrate, programs_to_compile, collective_seconds
from jaxserve.planning.targets import Target
from jaxserve.runner.programs import abstract_lora, abstract_weights
from jaxserve.quant import kv as kv_quant

DECODE_BATCHES = (1, 8, 64)          # plus max_num_seqs
SWEEP_COMPILE_LAYERS = 2             # --sweep compiles this many layers of each layout (then scales)


class CompileProgress(Protocol):
    """Hears a plan's compiles as they happen (report.py prints them: a target's compiles take
    minutes). `start` once per plan before its programs compile; `compiled` from the compiling
    threads as each program finishes, so an implementation must be thread-safe."""

    def start(self, layout: str, programs: list[str], layers: int, model_layers: int) -> None: ...

    def compiled(self, program: str, seconds: float) -> None: ...


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
    lora_bytes: int                     # the LoRA slots (--enable-lora), per device
    state_bytes: int                    # a hybrid stack's recurrent-state slots (and snapshots), per device
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


def weight_bytes_per_device(cfg: ModelConfig, dtype: Any, placement: sharding.Placement) -> int:
    """Bytes of the weight shards one device holds (from the declaration the loaders place by)."""
    return sharding.bytes_per_device(abstract_weights(cfg, dtype, placement))


def _attention_flops(cfg: ModelConfig, q_tokens: int, context: int) -> float:
    """QK^T and PV of q_tokens queries over `context` keys, all layers (a sliding one over its
    window at most; per replica)."""
    keys = sum(min(context, w or context) for w in cfg.attention_windows)
    # q.k over head_dim lanes and p.v over the value lanes (MLA absorbed: the latent row, and its latent part)
    v_width = cfg.head_dim if cfg.mla is None else cfg.mla.kv_lora_rank
    return 2.0 * q_tokens * keys * (cfg.head_dim + v_width) * cfg.num_heads


def _machine(target: Target, mesh: jax.sharding.Mesh, weight_bytes: int) -> MachineInfo:
    chip = target.chip
    if chip.platform == "cpu":
        from jaxserve.runner.machine import machine_info
        here = machine_info(mesh)
        # serving reads MemAvailable after loading the weights: they are no longer available then
        return dataclasses.replace(here, memory_per_device=max(0, here.memory_per_device - weight_bytes))
    return MachineInfo(chip.platform, chip.device_kind, chip.hbm_bytes, weight_bytes, 1)


def plan_deployment(model: ModelConfig, target: Target, layout: Layout, engine: EngineConfig, dtype: Any,
                    *, context: int | None = None, programs: str = "serving", batch: int | None = None,
                    compile_programs: bool = True, compile_layers: int | None = None,
                    progress: CompileProgress | None = None) -> DevicePlan:
    """The plan of one replica (see the module docstring). `context`: the tokens each decoding
    sequence has in cache for the step estimates (default: max_model_len); `programs`: which
    programs to compile ("serving" or "all"; see programs_to_compile); `compile_layers`: compile
    a copy of the model this deep (faster; what scales with depth is scaled back); `progress`:
    told of each compile as it finishes."""
    dtype = jnp.dtype(dtype)
    notes = check_divides(layout, model)
    rules = layout.rules
    model = duplicated_config(model, kv_duplication(model, layout.tp, rules))  # as the runner does
    devices = target.devices()[: layout.tp]
    mesh = sharding.make_mesh(1, layout.tp, devices)
    placement = sharding.Placement(mesh, rules)
    weight_bytes = weight_bytes_per_device(model, dtype, placement)
    lora_bytes = sharding.bytes_per_device(abstract_lora(model, engine, dtype, placement))
    machine = _machine(target, mesh, weight_bytes)
    chip = target.chip
    utilization = engine.memory_utilization or capacity.DEFAULT_MEMORY_UTILIZATION[chip.platform]
    usable = int(utilization * chip.hbm_bytes)
    model_axis_kv = layout.tp if dict(rules).get("kv_heads") == sharding.MODEL_AXIS else 1
    per_token = kv_bytes_per_token(model, dtype.itemsize, model_axis_kv, engine.kv_cache_dtype, chip.platform)
    advice: list[str] = []
    sized_from_memory = engine.num_kv_pages is None and engine.kv_cache_memory is None
    try:
        cap = capacity.plan_capacity(engine, model, machine, dtype.itemsize, model_axis_kv, lora_bytes=lora_bytes)
        resolved, pool_bytes, est_temp = cap.engine, cap.kv_pool_bytes, cap.temp_bytes
    except ValueError as e:
        # Nothing fits: plan the smallest engine that could run (one full-length sequence), so the
        # programs still compile and the report says by how much it is short.
        notes.append(str(e))
        max_len = engine.max_model_len or capacity.model_context(model)
        pages = model.kv_groups.pages_to_hold(max_len, engine.page_size, engine.max_num_batched_tokens or max_len)
        resolved = capacity.plan_capacity(
            dataclasses.replace(engine, num_kv_pages=pages, kv_cache_memory=None), model, machine,
            dtype.itemsize, model_axis_kv).engine
        pool_bytes, est_temp, sized_from_memory = pages * engine.page_size * per_token, 0, False

    to_compile = programs_to_compile(resolved, model, programs, batch)
    attention = make_attention(resolved.attention_backend, model, placement)
    b = min(batch or resolved.max_num_seqs, resolved.max_num_seqs)
    decode_bucket = choose_bucket(declared_buckets(resolved), b, b)  # its collectives are reported
    page_bytes, fixed, slope, code, colls, compile_s, program_temps = (
        per_token * resolved.page_size, est_temp, 0.0, 0, [], 0.0, {})
    compiled_ok = False
    if compile_programs:
        start = time.perf_counter()
        try:
            cal = calibrate(to_compile, model, resolved, placement, dtype, attention, compile_layers, decode_bucket,
                            **_progress_callbacks(progress, layout.name, model.num_layers))
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
            room = usable - weight_bytes - lora_bytes - _state_bytes(model, resolved, dtype) - code - fixed
            pages = capacity.stable_page_count(max(0, int(room // (page_bytes + slope))))
            resolved = dataclasses.replace(resolved, num_kv_pages=max(1, min(resolved.num_kv_pages, pages)))
        pool_bytes = int(resolved.num_kv_pages * page_bytes)
        program_temps = {c.name: int(c.temp_at(resolved.num_kv_pages)) for c in cal.costs}
    # the pool that fits: pages x (page + per-page temporaries) + fixed costs <= usable
    temp = int(fixed + slope * resolved.num_kv_pages)
    state_bytes = _state_bytes(model, resolved, dtype)
    total = weight_bytes + lora_bytes + state_bytes + pool_bytes + temp + code
    max_pages = max(0, int((usable - weight_bytes - lora_bytes - state_bytes - code - fixed) // (page_bytes + slope)))
    max_pool = int(max_pages * page_bytes)
    max_tokens = max_pages * resolved.page_size
    steps = _step_estimates(model, chip, layout, resolved, dtype, weight_bytes, per_token, colls, decode_bucket[0],
                            context or resolved.max_model_len, resolved.num_kv_pages, batch)
    fits = total <= usable and (compiled_ok or not compile_programs)
    if not fits:
        advice = _advice(model, target, layout, resolved, dtype, weight_bytes, temp + code + lora_bytes, per_token,
                         usable)
    settings = {k: getattr(resolved, k) for k in ("max_num_seqs", "max_num_batched_tokens", "max_model_len",
                                                  "page_size", "num_kv_pages", "memory_utilization",
                                                  "kv_cache_dtype")}
    settings["token_buckets"] = list(resolved.resolved_token_buckets())
    settings["seq_buckets"] = list(resolved.resolved_seq_buckets())
    return DevicePlan(
        target=target.name, device_kind=chip.device_kind, layout=layout.name, tp=layout.tp,
        replicas=layout.replicas, dtype=dtype.name, settings=settings,
        hbm_bytes=chip.hbm_bytes, usable_bytes=usable, weight_bytes=weight_bytes, lora_bytes=lora_bytes,
        state_bytes=state_bytes,
        kv_pool_bytes=pool_bytes,
        temp_bytes=temp, code_bytes=code, total_bytes=total, fits=fits, headroom_bytes=usable - total,
        max_kv_pool_bytes=max_pool, max_kv_tokens=int(max_tokens),
        max_seqs_at_max_len=int(_held(model, resolved, max_pages, resolved.max_model_len)),
        programs_compiled=len(to_compile) if compile_programs else 0, compile_seconds=compile_s,
        program_temps=program_temps,
        collectives=colls, steps=steps, notes=notes, advice=advice)


def _state_bytes(model: ModelConfig, engine: EngineConfig, dtype: Any) -> int:
    """A hybrid stack's recurrent-state slots and snapshots on each device (0 without linear layers)."""
    slots = sum(capacity.state_slot_counts(model, engine.max_num_seqs, engine.enable_prefix_caching))
    return slots * linear_state_bytes(model, dtype.itemsize)


def _held(model: ModelConfig, engine: EngineConfig, num_pages: int, tokens: int) -> float:
    """Sequences of `tokens` tokens that `num_pages` hold at once (kv_groups.sequences_held)."""
    return model.kv_groups.sequences_held(num_pages, tokens, engine.page_size, engine.max_num_batched_tokens)


def _progress_callbacks(progress: CompileProgress | None, layout: str, model_layers: int) -> dict[str, Any]:
    """calibrate's on_start / on_program for `progress` (calibrate knows neither layout nor model depth)."""
    if progress is None:
        return {}

    def on_start(names: list[str], layers: int) -> None:
        progress.start(layout, names, layers, model_layers)
    return {"on_start": on_start, "on_program": progress.compiled}


def _step_estimates(cfg: ModelConfig, chip: Any, layout: Layout, engine: EngineConfig, dtype: Any,
                    weight_bytes: int, kv_per_token: int, colls: list[Collective], colls_tokens: int,
                    context: int, num_pages: int, batch: int | None = None) -> list[StepEstimate]:
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
    fit = min(engine.max_num_seqs, max(1, int(_held(cfg, engine, num_pages, context))))  # sequences of `context` held
    layer_bytes = kv_per_token / cfg.kv_groups.num_arrays  # one layer's K/V of one token (pool arrays are shared)
    # a sequence's K/V read per decode step: each layer's context, a sliding layer's window at most
    kv_read = layer_bytes * sum(min(context + 1, w or context + 1) for w in cfg.attention_windows)
    kv_read += 2 * linear_state_bytes(cfg, dtype.itemsize)  # a hybrid's states: read and written
    for b in sorted({b for b in (*DECODE_BATCHES, engine.max_num_seqs, batch or 1) if b <= fit} | {fit}):
        t, s = choose_bucket(buckets, b, b)
        flops = (t * flops_per_token(cfg) + _attention_flops(cfg, b, context) + s * flops_per_sampled_row(cfg)) / tp
        out.append(estimate(f"decode b={b}", b, t, s, flops, weight_bytes + b * kv_read))
    n = engine.max_num_batched_tokens
    t, s = choose_bucket(buckets, n, 1)
    flops = (t * flops_per_token(cfg) + _attention_flops(cfg, n, n) / 2 + s * flops_per_sampled_row(cfg)) / tp
    activations = 2 * n * cfg.hidden_size * dtype.itemsize * cfg.num_layers
    out.append(estimate(f"prefill T={n}", n, t, s, flops, weight_bytes + n * layer_bytes * cfg.num_layers
                        + activations))
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
          context: int, compile_layers: int | None = SWEEP_COMPILE_LAYERS,
          progress: CompileProgress | None = None) -> list[DevicePlan]:
    """Every candidate layout (layouts.candidate_layouts) planned at `batch` sequences of
    `context` tokens, best decode tokens/s per chip first (fitting layouts before the rest).
    `progress` hears each layout's compiles (layouts are planned one after another)."""
    from jaxserve.parallel.layouts import candidate_layouts

    plans = []
    for layout in candidate_layouts(model, target.num_devices):
        eng = dataclasses.replace(engine, max_num_seqs=engine.max_num_seqs or batch)
        plans.append(plan_deployment(model, target, layout, eng, dtype, context=context, batch=batch,
                                     compile_layers=compile_layers, progress=progress))
    return sorted(plans, key=lambda p: (not p.fits, -decode_tokens_per_chip(p, batch)))


def decode_step(plan: DevicePlan, batch: int) -> StepEstimate:
    """The decode estimate at `batch` sequences, or the largest batch below it the pool holds."""
    decodes = [s for s in plan.steps if s.what.startswith("decode")]
    return max((s for s in decodes if s.batch <= batch), key=lambda s: s.batch, default=decodes[0])


def decode_tokens_per_chip(plan: DevicePlan, batch: int) -> float:
    """Estimated decode tokens/s per device at `batch` sequences per replica (or fewer: decode_step)."""
    return decode_step(plan, batch).tokens_per_s / plan.tp
