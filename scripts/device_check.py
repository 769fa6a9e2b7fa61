"""The device check: the whole engine measured on an accelerator by one command, every stage under a
hard time limit, so that a partial run still returns what it measured.

    bash scripts/device_check.sh                      # a lent NVIDIA GPU (H200): results in $OUT
    bash scripts/tpu_check.sh                         # a TPU VM
    python scripts/device_check.py --dry-run          # this CPU, tiny shapes: the same stages and JSON
                                                      # (tests/test_device_check.py runs it)

Stages, in order, each a child process (scripts/device_stages.py) killed at its limit:
  env       versions, devices, memory
  kernels   the platform's marked kernel tests, then each Pallas kernel the serving path uses,
            compiled, against its reference at serving shapes (attention in bf16 and f32, over int8
            and fp8 pages; MoE's grouped matmul)
  serve     `jaxserve serve` with default flags on a Qwen3-8B-shaped model of random weights drawn on
            the device (--load-format dummy), a burst from scripts/bench_serving.py: output tok/s,
            TTFT, TPOT, and the decode step (from /metrics) against the HBM roofline and against
            `jaxserve plan`'s prediction (the plan stage, run on the host's CPUs beside the next stages)
  peer      transformers on the same shape and workload (static batch; continuous batching if it runs)
  features  int8 / fp8 KV pages, int8 weights, n-gram speculation, LoRA, a JSON schema: each one's
            programs run once, its tokens against the plain engine's
Writes device_check.json, device_check.md, device_check.log and server.log to --out ($OUT, else
./device-check). Exit status 1 when a stage failed (a stage stopped at its time limit is SKIPPED, not
failed: it reports what it measured).
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, TextIO

sys.path.insert(0, str(Path(__file__).resolve().parent))
from device_profile import PROFILES, REPO, STAGES, Profile, dry_run  # noqa: E402

if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
from jaxserve.core.capacity import DEFAULT_MAX_NUM_SEQS  # noqa: E402

STAGE_SCRIPT = Path(__file__).resolve().parent / "device_stages.py"
EXIT_MARGIN_S = 8.0   # kept for the report after the last stage


class Check:
    def __init__(self, profile: Profile, out: Path, work: Path, budget_s: float, stages: tuple[str, ...]) -> None:
        self.profile, self.out, self.work, self.stages = profile, out, work, stages
        self.start = time.monotonic()
        self.deadline = self.start + budget_s
        self.results: dict[str, dict[str, Any]] = {}
        self.log: TextIO = open(out / "device_check.log", "a", buffering=1)
        self.profile_path = work / "profile.json"
        self.profile_path.write_text(json.dumps(profile.to_json()))

    def say(self, text: str) -> None:
        line = f"[{time.monotonic() - self.start:6.1f}s] {text}"
        print(line, flush=True)
        self.log.write(line + "\n")

    def left(self) -> float:
        return self.deadline - time.monotonic() - EXIT_MARGIN_S

    def spawn(self, stage: str, args: dict | None = None) -> tuple[subprocess.Popen, Path]:
        result = self.work / f"{stage}.json"
        result.unlink(missing_ok=True)
        cmd = [sys.executable, str(STAGE_SCRIPT), stage, str(self.profile_path), str(self.work / stage), str(result),
               json.dumps(args or {})]
        proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)
        return proc, result

    def collect(self, stage: str, proc: subprocess.Popen, result: Path, limit: float, started: float) -> None:
        """Waits for a stage up to `limit` seconds after `started`; a stage still running then is
        killed (its process group) and reported SKIPPED (time limit) with what it had written."""
        try:
            proc.wait(timeout=max(0.0, started + limit - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        data = json.loads(result.read_text()) if result.exists() else {}
        if data.get("status") in (None, "RUNNING"):
            data["status"] = "SKIPPED" if proc.returncode == -signal.SIGKILL else "FAIL"
            data.setdefault("error", f"stopped at its {limit:.0f} s time limit" if data["status"] == "SKIPPED"
                            else f"the stage process exited with {proc.returncode} before reporting")
        elif proc.returncode:  # it reported, then died: what it reported stands, and why it is short
            data.setdefault("error", f"the stage process exited with {proc.returncode} after reporting")
        data["seconds"] = time.monotonic() - started
        data["limit_s"] = limit
        self.results[stage] = data
        self.say(f"{stage}: {data['status']} in {data['seconds']:.1f} s"
                 + (f" ({data['error'][:200]})" if data.get("error") else ""))

    def run(self, stage: str, args: dict | None = None) -> None:
        if stage in self.profile.not_run:
            self.results[stage] = dict(status="NOT RUN", error=self.profile.not_run[stage])
            self.say(f"{stage}: NOT RUN ({self.profile.not_run[stage]})")
            return
        limit = self._limit(stage)
        if limit is None:
            return
        self.say(f"{stage}: started (limit {limit:.0f} s)")
        started = time.monotonic()
        proc, result = self.spawn(stage, {**(args or {}), "seconds": limit})
        self.collect(stage, proc, result, limit, started)

    def _limit(self, stage: str) -> float | None:
        """The stage's limit within what is left, keeping the later stages' floors in reserve; None
        (and SKIPPED) when not even its own floor is left."""
        later = self.stages[self.stages.index(stage) + 1:] if stage in self.stages else ()
        reserve = sum(self.profile.floors[s] for s in later if s not in self.profile.not_run)
        limit = min(self.profile.limits[stage], self.left() - reserve)
        if limit < self.profile.floors.get(stage, 0):
            self.results[stage] = dict(status="SKIPPED", error=f"not started: {self.left():.0f} s left of the budget")
            self.say(f"{stage}: SKIPPED (time limit: {self.left():.0f} s left)")
            return None
        return limit


def run_check(profile: Profile, out: Path, budget_s: float, stages: tuple[str, ...] = STAGES) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="device-check-") as tmp:
        check = Check(profile, out, Path(tmp), budget_s, stages)
        check.say(f"device check, profile {profile.name}, budget {budget_s:.0f} s, stages {', '.join(stages)}")
        plan = None
        plan_after = "serve" if "serve" in stages else "env"  # the measured decode's shape, when there is one
        for stage in stages:
            check.run(stage)
            if stage == plan_after:
                plan = _start_plan(check)
        if plan is not None:
            proc, result, started = plan
            check.collect("plan", proc, result, max(0.0, min(profile.limits["plan"], check.left())), started)
        server_log = Path(tmp) / "serve" / "server.log"
        if server_log.exists():
            (out / "server.log").write_bytes(server_log.read_bytes()[-4_000_000:])
        try:
            report = make_report(profile, check.results, time.monotonic() - check.start)
        except Exception:  # what was measured still comes back, with the reason the report is short
            check.say(f"report: FAIL\n{traceback.format_exc()}")
            report = dict(date=dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), profile=profile.name,
                          dry_run=profile.platform == "cpu", seconds=time.monotonic() - check.start, stages=check.results,
                          summary={**{s: check.results.get(s, {}).get("status", "NOT RUN") for s in (*STAGES, "plan")},
                                   "report": "FAIL"}, error=traceback.format_exc())
        check.log.close()
    (out / "device_check.json").write_text(json.dumps(report, indent=1, default=str))
    try:
        (out / "device_check.md").write_text(markdown(report))
    except Exception:
        (out / "device_check.md").write_text(f"the markdown report failed:\n\n```\n{traceback.format_exc()}```\n")
    return report


def _start_plan(check: Check) -> tuple[subprocess.Popen, Path, float]:
    """`jaxserve plan` started in the background (host CPUs only) while the next stages hold the
    accelerator: at the served run's largest decode bucket's mean batch and context, or, without
    one, at the burst's (all its requests decoding, halfway through their outputs)."""
    steps = check.results.get("serve", {}).get("decode_steps")
    if steps:
        batch = max(1, round(steps[-1]["rows"]))
        context = max(1, round(steps[-1]["context_tokens"] / steps[-1]["rows"]))
    else:
        w = check.profile.workload
        batch = min(w.num_requests, DEFAULT_MAX_NUM_SEQS)
        context = round(sum(w.prompt_len) / 2 + sum(w.output_len) / 4)
    target = plan_target(check.profile, check.results.get("env", {}).get("device_kind"))
    check.say(f"plan: started in the background ({target}, decode b={batch}, context {context})")
    proc, result = check.spawn("plan", {"batch": batch, "context": context, "target": target})
    return proc, result, time.monotonic()


def plan_target(profile: Profile, device_kind: str | None) -> str:
    """One chip of the kind the check ran on (the served engine's mesh is 1x1), else the profile's."""
    from jaxserve.planning.targets import CHIPS

    chip = next((c for c in CHIPS.values() if c.device_kind == device_kind), None)
    if chip is None:
        return profile.target
    return f"{chip.platform}-{chip.name}:" + ("1x1" if chip.name in ("v5e", "v6e") else "1x1x1")  # v5p and GPUs: 3-D


# --- the report ------------------------------------------------------------------------------------

def make_report(profile: Profile, results: dict[str, dict[str, Any]], seconds: float) -> dict[str, Any]:
    report: dict[str, Any] = dict(
        date=dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), profile=profile.name,
        dry_run=profile.platform == "cpu", seconds=seconds, stages=results,
        summary={stage: results.get(stage, {}).get("status", "NOT RUN") for stage in (*STAGES, "plan")})
    serve = results.get("serve", {})
    if serve.get("decode_steps"):
        report["decode"] = decode_against_bounds(profile, serve["decode_steps"][-1], results)
    peer = results.get("peer", {})
    served = serve.get("bench", {}).get("output_throughput")
    if served:
        report["vs_transformers"] = {kind: served / figures(peer, kind)["output_throughput"]
                                     for kind in ("static", "continuous") if figures(peer, kind).get("output_throughput")}
    return report


def figures(stage: dict[str, Any], key: str) -> dict[str, Any]:
    """A stage's measured figures under `key`, or {} when it holds none: not run, or a marker such
    as the peer's "running" left by a measurement its process did not finish."""
    value = stage.get(key)
    return value if isinstance(value, dict) else {}


def decode_against_bounds(profile: Profile, top: dict[str, float], results: dict[str, Any]) -> dict[str, Any]:
    """The largest bucket's mean decode step against the HBM roofline (every weight byte a decode
    reads, once, plus its sequences' KV, at the chip's published bandwidth) and the plan's estimate."""
    from jaxserve.core.capacity import kv_bytes_per_token
    from jaxserve.core.config import ModelConfig
    from jaxserve.planning.targets import CHIPS, parse_target

    cfg = ModelConfig.from_hf(profile.model)
    itemsize = 2 if profile.platform in ("gpu", "tpu") else 4  # the served dtype: bf16 on accelerators
    kind = results.get("env", {}).get("device_kind")
    chip = next((c for c in CHIPS.values() if c.device_kind == kind), None)
    bandwidth_of = chip.name if chip is not None else parse_target(profile.target).chip.name
    chip = chip or parse_target(profile.target).chip
    weights = decode_weight_bytes(cfg, itemsize)
    kv = top["context_tokens"] * kv_bytes_per_token(cfg, itemsize)
    roofline_s = (weights + kv) / chip.hbm_bandwidth
    out = dict(bucket=top["bucket"], rows=top["rows"], context_per_row=top["context_tokens"] / top["rows"],
               step_ms=top["step_ms"], weight_bytes=weights, kv_bytes=kv, hbm_bandwidth=chip.hbm_bandwidth,
               bandwidth_of=bandwidth_of, roofline_ms=1e3 * roofline_s,
               pct_of_roofline=100 * roofline_s / (top["step_ms"] / 1e3))
    plan = results.get("plan", {}).get("decode")
    if plan:
        out.update(plan_ms=1e3 * plan["seconds"], plan_batch=plan["batch"], measured_over_plan=top["step_ms"] / 1e3
                   / plan["seconds"])
    return out


def decode_weight_bytes(cfg: Any, itemsize: int) -> int:
    """Weight bytes one decode step reads: every layer and the lm_head, not the embedding table
    (a step gathers only its tokens' rows; with tied embeddings the lm_head reads it whole)."""
    import jax

    from jaxserve.model import weights as W

    specs = W.abstract(cfg)
    total = sum(math.prod(s.shape) for s in jax.tree.leaves(specs, is_leaf=W.is_spec))
    if not cfg.tie_word_embeddings:
        total -= math.prod(specs.embed.shape)
    return total * itemsize


def _fmt(x: Any, digits: int = 1) -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:,.{digits}f}"


def markdown(report: dict[str, Any]) -> str:
    r = report["stages"]
    env = r.get("env", {})
    lines = [f"### Device check {report['date']} — profile `{report['profile']}`"
             + (" (dry run: tiny shapes on a CPU)" if report["dry_run"] else ""), "",
             f"{env.get('device_kind', '?')} x{env.get('num_devices', '?')}; jax {env.get('packages', {}).get('jax', '?')}"
             f", python {env.get('python', '?')}; {env.get('cpu', '?')} ({env.get('cpu_count', '?')} cores); "
             f"{report['seconds']:.0f} s in all", "",
             "| stage | status | seconds | what it measured |", "|---|---|---|---|"]
    for stage, status in report["summary"].items():
        data = r.get(stage, {})
        lines.append(f"| {stage} | {status} | {_fmt(data.get('seconds'))} | {_stage_line(stage, data, report)} |")
    attention = r.get("kernels", {}).get("attention") or []
    if attention:
        lines += ["", "| attention case | dtype | pages | kernel ms | reference ms | GB/s | % of copy | rel err |",
                  "|---|---|---|---|---|---|---|---|"]
        lines += [f"| {a['case']} | {a['dtype']} | {a['pages']} | {a['kernel_ms']:.3f} | {a['reference_ms']:.3f} | "
                  f"{a['gbs']:.0f} | {a['pct_copy']:.1f} | {a['rel_err']:.1e} |" for a in attention]
    variants = r.get("features", {}).get("variants") or []
    if variants:
        lines += ["", "| feature | build + warm-up s | generate s | steps | ms / step | decode step ms | rows equal "
                  "to plain | token agreement |", "|---|---|---|---|---|---|---|---|"]
        for v in variants:
            equal = (f"{v['identical_rows']}/{v['rows']}" if "identical_rows" in v
                     else ("valid JSON" if v.get("valid") else "invalid JSON" if "valid" in v else "—"))
            lines.append(f"| {v['variant']} | {_fmt(v['build_s'])} | {_fmt(v['generate_s'], 2)} | {v.get('steps', '—')} | "
                         f"{_fmt(v.get('step_ms'), 2)} | {_fmt(v.get('decode_step_ms'), 2)} | {equal} | "
                         f"{_fmt(v.get('prefix_agreement'), 2)} |")
    return "\n".join(lines) + "\n"


def _stage_line(stage: str, data: dict[str, Any], report: dict[str, Any]) -> str:
    if data.get("error") and data.get("status") != "PASS":
        return data["error"].splitlines()[0][:160]
    if stage == "env":
        return f"{data.get('backend')}: {data.get('nvidia_smi') or data.get('device_kind')}"
    if stage == "kernels":
        moe = data.get("moe") or {}
        return (f"{len(data.get('attention') or [])} attention cases match ({data.get('kernel_tests', 'no marked tests')})"
                f"; grouped matmul {_fmt(moe.get('tflops'))} TFLOP/s")
    if stage == "serve":
        b, d = data.get("bench") or {}, report.get("decode") or {}
        return (f"ready in {_fmt(data.get('ready_s'))} s ({data.get('warmup_programs', '?')} programs, warm-up "
                f"{_fmt(data.get('warmup_s'))} s); {b.get('completed', 0)} requests: {_fmt(b.get('output_throughput'), 0)} "
                f"output tok/s, TTFT p50/p99 {_fmt((b.get('ttft_ms') or {}).get('p50'), 0)}/"
                f"{_fmt((b.get('ttft_ms') or {}).get('p99'), 0)} ms, TPOT p50 {_fmt((b.get('tpot_ms') or {}).get('p50'))} ms; "
                f"decode step {_fmt(d.get('step_ms'), 2)} ms at {_fmt(d.get('rows'), 0)} rows x "
                f"{_fmt(d.get('context_per_row'), 0)} tokens = {_fmt(d.get('pct_of_roofline'))} % of the HBM roofline "
                f"({_fmt(d.get('roofline_ms'), 2)} ms, {d.get('bandwidth_of')}), {_fmt(d.get('measured_over_plan'), 2)}x "
                f"the plan's {_fmt(d.get('plan_ms'), 2)} ms")
    if stage == "peer":
        ratio = report.get("vs_transformers") or {}
        static, cont = figures(data, "static"), figures(data, "continuous")
        return (f"static {_fmt(static.get('output_throughput'), 0)} tok/s (jaxserve {_fmt(ratio.get('static'), 2)}x); "
                f"continuous {_fmt(cont.get('output_throughput'), 0)} tok/s (jaxserve {_fmt(ratio.get('continuous'), 2)}x)")
    if stage == "features":
        return f"{len(data.get('variants') or [])} variants; " + ("; ".join(data.get("failed") or []) or "all as required")
    if stage == "plan":
        d = data.get("decode") or {}
        return f"{data.get('target')}: decode b={d.get('batch')} {_fmt(1e3 * d['seconds'] if d else None, 2)} ms ({d.get('bound')})"
    return ""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", choices=tuple(PROFILES), default="gpu")
    p.add_argument("--dry-run", action="store_true", help="the same stages on this CPU at tiny shapes")
    p.add_argument("--budget", type=float, default=None, help="seconds for the whole check (default: the profile's)")
    p.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated subset of {','.join(STAGES)}")
    p.add_argument("--out", default=os.environ.get("OUT") or "device-check", help="where the results go")
    a = p.parse_args(argv)
    profile = dry_run(a.profile) if a.dry_run else PROFILES[a.profile]
    if a.dry_run:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")  # an installed CUDA plugin would look for a GPU
    stages = tuple(s for s in STAGES if s in a.stages.split(","))
    report = run_check(profile, Path(a.out), a.budget or profile.budget_s, stages)
    print((Path(a.out) / "device_check.md").read_text())
    for stage, status in report["summary"].items():
        print(f"{stage:<9} {status}")
    return 1 if "FAIL" in report["summary"].values() else 0


if __name__ == "__main__":
    sys.exit(main())
