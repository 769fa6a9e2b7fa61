"""`jaxserve plan` output: the text table, JSON, and the PNG charts (matplotlib, imported only
for --plot), and the command itself (argparse namespace -> plan -> report)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any, TextIO

from jaxserve.planning.plan import DevicePlan, decode_step, decode_tokens_per_chip, human_bytes


class CompilePrinter:
    """Prints the planner's compiles as they happen (plan.CompileProgress), so the minutes a
    compile-only target takes are not silent: a line before a layout's programs compile, one per
    program as it finishes, and summary() at the end. To stderr: stdout may carry `--json -`.
    `compiled` is called from the compiling threads: a lock keeps each line whole and the count
    right, and lines come out in completion order. Sweeps (layouts > 1) prefix lines with the layout."""

    def __init__(self, target: str, layouts: int = 1, stream: TextIO | None = None) -> None:
        self.target, self.layouts = target, layouts
        self._stream = stream   # None: sys.stderr when printing (what pytest's capsys replaces)
        self._lock = threading.Lock()
        self._began: float | None = None
        self._layout, self._layout_number, self._of, self._done = "", 0, 0, 0
        self._programs, self._seconds = 0, 0.0

    def start(self, layout: str, programs: list[str], layers: int, model_layers: int) -> None:
        with self._lock:
            if self._began is None:
                self._began = time.perf_counter()
            self._layout, self._of, self._done = layout, len(programs), 0
            self._layout_number += 1
            depth = "all" if layers == model_layers else f"{layers} of"
            which = (f"layout {self._layout_number} of {self.layouts}" if self.layouts > 1
                     else f"layout {layout}")
            self._print(f"compiling {_count(len(programs), 'program')} for {self.target}, {which}, {depth} "
                        f"{model_layers} layers (a forward compiles at 2 KV pool sizes): " + ", ".join(programs))

    def compiled(self, program: str, seconds: float) -> None:
        with self._lock:
            self._done += 1
            self._programs += 1
            self._seconds += seconds
            self._print(f"compiled {program} for {self.target}: {seconds:.1f} s [{self._done}/{self._of}]")

    def summary(self) -> None:
        """The closing line: programs, wall time since compiling began, and compile time summed over
        the threads (more than the wall time when programs compiled side by side)."""
        with self._lock:
            if self._began is None:
                return  # nothing was compiled
            wall = time.perf_counter() - self._began
            layouts = f" for {_count(self._layout_number, 'layout')}" if self.layouts > 1 else ""
            self._layout = ""
            self._print(f"compiled {_count(self._programs, 'program')}{layouts} in {wall:.1f} s (wall), "
                        f"{self._seconds:.1f} s of compiling")

    def _print(self, line: str) -> None:
        prefix = f"[{self._layout}] " if self.layouts > 1 and self._layout else ""
        print(prefix + line, file=self._stream or sys.stderr, flush=True)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def format_plan(plan: DevicePlan) -> str:
    """One plan as a text table (the command's default output)."""
    h = human_bytes
    usable = f"usable ({plan.settings['memory_utilization']:.2f} x {h(plan.hbm_bytes)})"
    lines = [f"target {plan.target} ({plan.device_kind}), layout {plan.layout}, {plan.dtype}",
             "settings: " + ", ".join(f"{k}={v}" for k, v in plan.settings.items()),
             "",
             "memory per device",
             f"  {'weights':<32}{h(plan.weight_bytes):>12}",
             *([f"  {'LoRA slots':<32}{h(plan.lora_bytes):>12}"] if plan.lora_bytes else []),
             *([f"  {'recurrent-state slots':<32}{h(plan.state_bytes):>12}"] if plan.state_bytes else []),
             f"  {'KV pool':<32}{h(plan.kv_pool_bytes):>12}",
             f"  {'compiled temporaries':<32}{h(plan.temp_bytes):>12}",
             f"  {'program code':<32}{h(plan.code_bytes):>12}",
             f"  {'total':<32}{h(plan.total_bytes):>12}",
             f"  {usable:<32}{h(plan.usable_bytes):>12}",
             f"  -> {'FITS' if plan.fits else 'DOES NOT FIT'}: "
             f"{'headroom' if plan.fits else 'short by'} {h(abs(plan.headroom_bytes))}",
             f"  largest KV pool that fits: {h(plan.max_kv_pool_bytes)} = {plan.max_kv_tokens} tokens = "
             f"{plan.max_seqs_at_max_len} sequences at max_model_len {plan.settings['max_model_len']}",
             "",
             f"{'step':<16}{'bucket':<14}{'GFLOP/dev':>11}{'GB/dev':>9}{'coll MB':>9}{'ms':>9}  {'bound':<12}"
             f"{'tok/s/replica':>14}"]
    for s in plan.steps:
        lines.append(f"{s.what:<16}{s.bucket:<14}{s.flops / 1e9:>11.2f}{s.bytes / 1e9:>9.3f}"
                     f"{s.collective_bytes / 1e6:>9.2f}{s.seconds * 1e3:>9.3f}  {s.bound:<12}{s.tokens_per_s:>14,.0f}")
    if plan.collectives:
        lines += ["", "collectives per decode step (compiled HLO): " + ", ".join(
            f"{c.kind} x{c.count} ({h(c.bytes)})" for c in plan.collectives)]
    lines.append(f"compiled {plan.programs_compiled} programs for {plan.target} in {plan.compile_seconds:.1f}s; "
                 "temporaries: " + ", ".join(f"{name} {h(b)}" for name, b in plan.program_temps.items()))
    lines += [f"note: {n}" for n in plan.notes]
    lines += [f"to fit: {a}" for a in plan.advice]
    return "\n".join(lines)


def format_sweep(plans: list[DevicePlan], batch: int, context: int) -> str:
    lines = [f"layouts on {plans[0].target} ({plans[0].device_kind}), {plans[0].dtype}, decode at {batch} sequences "
             f"per replica x {context} tokens of context; best first",
             f"{'layout':<32}{'fits':<6}{'headroom':>12}{'weights/dev':>13}{'KV/seq/dev':>12}{'tok/s/chip':>12}"
             f"{'step ms':>9}  bound"]
    for p in plans:
        step = decode_step(p, batch)
        kv_per_seq = p.max_kv_pool_bytes / max(1, p.max_kv_tokens) * context
        lines.append(f"{p.layout:<32}{'yes' if p.fits else 'no':<6}{human_bytes(p.headroom_bytes):>12}"
                     f"{human_bytes(p.weight_bytes):>13}{human_bytes(kv_per_seq):>12}"
                     f"{decode_tokens_per_chip(p, batch):>12,.0f}{step.seconds * 1e3:>9.3f}  {step.bound} (b={step.batch})")
    return "\n".join(lines)


def plot_plan(plan: DevicePlan, path: Path) -> None:
    plt = _pyplot()
    fig, (mem, speed) = plt.subplots(1, 2, figsize=(11, 4))
    parts = [("weights", plan.weight_bytes), ("LoRA slots", plan.lora_bytes), ("recurrent states", plan.state_bytes),
             ("KV pool", plan.kv_pool_bytes), ("temporaries", plan.temp_bytes),
             ("code", plan.code_bytes)]
    bottom = 0.0
    for name, value in parts:
        mem.bar(["per device"], [value / 2**30], bottom=[bottom], label=name)
        bottom += value / 2**30
    mem.axhline(plan.usable_bytes / 2**30, color="k", linestyle="--", label="usable")
    mem.axhline(plan.hbm_bytes / 2**30, color="r", linestyle=":", label="HBM")
    mem.set_ylabel("GiB")
    mem.set_title(f"{'fits' if plan.fits else 'does not fit'}: {plan.target}")
    mem.legend(fontsize=8)
    decode = [s for s in plan.steps if s.what.startswith("decode")]
    speed.plot([s.batch for s in decode], [s.tokens_per_s for s in decode], marker="o")
    speed.set_xscale("log", base=2)
    speed.set_xlabel("sequences decoding")
    speed.set_ylabel("tokens/s per replica (roofline)")
    speed.set_title(f"{plan.layout}, {plan.dtype}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def plot_sweep(plans: list[DevicePlan], batch: int, path: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 1.2 + 0.45 * len(plans)))
    ranked = plans[::-1]  # best on top
    ax.barh([p.layout for p in ranked], [decode_tokens_per_chip(p, batch) for p in ranked],
            color=["tab:green" if p.fits else "tab:gray" for p in ranked])
    ax.set_xlabel(f"decode tokens/s per chip, up to {batch} sequences per replica (roofline)")
    ax.set_title(f"{plans[0].target}: layouts (gray: does not fit)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def _pyplot() -> Any:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install matplotlib") from None
    return plt


def run(args: argparse.Namespace, engine: Any) -> int:
    """`jaxserve plan`: args from cli.py, `engine` the EngineConfig its flags give."""
    from jaxserve.core.quiet import quiet_startup

    quiet_startup()
    import jax
    import jax.numpy as jnp

    # Planning compiles for compile-only devices: this process needs no accelerator of its own (and
    # the CUDA plugin fails at start-up on a machine without a GPU).
    jax.config.update("jax_platforms", "cpu")

    from jaxserve.core.config import ModelConfig
    from jaxserve.core.hf_families import normalize_dtype_name
    from jaxserve.quant.scheme import online_scheme
    from jaxserve.parallel.layouts import make_layout
    from jaxserve.planning.plan import plan_deployment, sweep
    from jaxserve.planning.targets import parse_target

    target = parse_target(args.target)
    model = ModelConfig.from_hf(_config_path(args.model))
    if args.quantization is not None:
        model = dataclasses.replace(model, quantization=online_scheme(args.quantization))
    if args.dtype == "auto":  # what serving picks: float32 on a CPU, the checkpoint's dtype elsewhere
        dtype = jnp.float32 if target.chip.platform == "cpu" else jnp.dtype(model.dtype)
    else:
        dtype = jnp.dtype(normalize_dtype_name(args.dtype))
    context = args.context
    if args.sweep:
        from jaxserve.parallel.layouts import candidate_layouts

        batch = args.batch or 64
        printer = CompilePrinter(target.name, len(candidate_layouts(model, target.num_devices)))
        plans = sweep(model, target, engine, dtype, batch=batch, context=context or engine.max_model_len or
                      min(8192, model.max_position_embeddings), compile_layers=args.compile_layers or 2,
                      progress=printer)
        printer.summary()
        text = format_sweep(plans, batch, context or plans[0].settings["max_model_len"])
        if args.plot:
            plot_sweep(plans, batch, Path(args.plot))
        payload: Any = [p.to_json() for p in plans]
    else:
        layout = make_layout(args.layout, target.num_devices, args.tp)
        printer = CompilePrinter(target.name)
        plan = plan_deployment(model, target, layout, engine, dtype, context=context,
                               programs="all" if args.all_programs else "serving", batch=args.batch,
                               compile_layers=args.compile_layers or (None if args.all_programs else 2),
                               progress=printer)
        printer.summary()
        text = format_plan(plan)
        if args.plot:
            plot_plan(plan, Path(args.plot))
        payload = plan.to_json()
    if args.json == "-":
        json.dump(payload, sys.stdout, indent=1, default=_jsonable)
        print()
    else:
        print(text)
        if args.json:
            Path(args.json).write_text(json.dumps(payload, indent=1, default=_jsonable))
    return 0


def _jsonable(x: Any) -> Any:
    return dataclasses.asdict(x) if dataclasses.is_dataclass(x) else str(x)


def _config_path(model: str) -> Path:
    """A config.json, a model directory, or a cached hub id -> the config.json to read."""
    path = Path(model).expanduser()
    if path.is_file():
        return path
    from checkpoints import resolve_model_dir
    return resolve_model_dir(model) / "config.json"
