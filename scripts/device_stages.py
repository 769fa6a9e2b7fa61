"""The device check's stages, each run in a child process of scripts/device_check.py:

    python scripts/device_stages.py STAGE PROFILE_JSON WORK_DIR RESULT_JSON [ARGS_JSON]

A stage writes its figures into RESULT_JSON as it goes (`Result.set`), so a stage killed at its
time limit still reports what it had measured; it ends by setting its status (PASS / FAIL).
Stages: env, kernels, serve, plan (here), peer (device_peer.py), features (device_features.py).
"""
from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from device_profile import REPO, Profile, model_dir  # noqa: E402

if str(REPO) not in sys.path:  # the device machine runs the checkout without installing it
    sys.path.insert(0, str(REPO))

PACKAGES = ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda12-plugin", "libtpu", "flax", "orbax-checkpoint",
            "transformers", "tokenizers", "torch", "triton", "numpy", "tokamax", "qwix", "llguidance", "starlette",
            "uvicorn")


class Result:
    """A stage's figures, written to its file on every change (the parent reads it even after a kill)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.data: dict[str, Any] = {"status": "RUNNING"}
        self._write()

    def set(self, **values: Any) -> None:
        self.data.update(values)
        self._write()

    def note(self, text: str) -> None:
        self.data.setdefault("notes", []).append(text)
        self._write()

    def _write(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        os.replace(tmp, self.path)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def versions() -> dict[str, str]:
    out = {}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


# --- env -------------------------------------------------------------------------------------------

def stage_env(profile: Profile, work: Path, result: Result, args: dict) -> None:
    import platform

    from bench_common import cpu_model

    result.set(python=platform.python_version(), packages=versions(), cpu=cpu_model(), cpu_count=os.cpu_count())
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version,clocks.max.sm",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
        if smi.returncode == 0:
            result.set(nvidia_smi=smi.stdout.strip())
    except (OSError, subprocess.TimeoutExpired):
        pass
    import jax

    devices = jax.devices()
    stats = devices[0].memory_stats() or {}
    result.set(backend=jax.default_backend(), device_kind=devices[0].device_kind, num_devices=len(devices),
               memory_bytes_limit=stats.get("bytes_limit"))
    expected = "gpu" if profile.platform == "gpu" else profile.platform
    if jax.default_backend() != expected:
        raise RuntimeError(f"jax runs on {jax.default_backend()!r}, the {profile.name} profile expects {expected!r}")
    result.set(status="PASS")


# --- kernels ---------------------------------------------------------------------------------------

def stage_kernels(profile: Profile, work: Path, result: Result, args: dict) -> None:
    """The platform's marked kernel tests (compiled), then each kernel against its reference at
    serving shapes: attention in bf16 and f32, over int8 and fp8 pages, and MoE's grouped matmul."""
    deadline = time.monotonic() + float(args.get("seconds", 60))
    failed = []
    marker = {"gpu": "gpu", "tpu": "tpu"}.get(profile.platform)
    if marker is not None:
        failed += _kernel_tests(marker, result, min(60.0, (deadline - time.monotonic()) / 2))
    for part in (_attention_cases, _moe_case):  # one part's error does not hide the other's figures
        try:
            failed += part(profile, result)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            failed.append(f"{part.__name__.strip('_')}: {type(e).__name__}: {str(e)[:500]}")
    result.set(status="FAIL" if failed else "PASS", failed=failed)


def _kernel_tests(marker: str, result: Result, seconds: float) -> list[str]:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "-m", marker,
           str(REPO / "tests" / "kernels")]
    env = {**os.environ, "XLA_FLAGS": os.environ.get("XLA_FLAGS", "")}  # not the suite's CPU flags
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds, cwd=REPO, env=env)
    except subprocess.TimeoutExpired:
        result.set(kernel_tests=f"stopped at its {seconds:.0f} s limit")
        return []
    summary = (run.stdout.strip().splitlines() or ["(no output)"])[-1]
    result.set(kernel_tests=summary)
    if run.returncode not in (0, 5):  # 5: no test selected
        print(run.stdout[-4000:], run.stderr[-2000:], flush=True)
        return [f"pytest -m {marker}: {summary}"]
    return []


def _attention_cases(profile: Profile, result: Result) -> list[str]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import kernel_bench as kb
    from kernels_pallas import get_attention_backend, kv_quant

    k = profile.kernels
    backend = {"gpu": "gpu", "tpu": "tpu"}.get(profile.platform, "gpu")  # dry run: the GPU kernel, interpreted
    kernel = get_attention_backend(backend)
    reference = get_attention_backend("reference")
    extra = {"interpret": True} if profile.interpret else {}
    dims = dict(num_q_heads=k.q_heads, num_kv_heads=k.kv_heads, head_dim=k.head_dim)
    cases = kb.default_cases(np.random.default_rng(0), k.num_seqs, k.max_context)
    cases = cases[:1] if profile.interpret else cases[:1] + cases[2:3]  # decode (and a mixed step)
    rows, failed = [], []
    copy_bw = kb.copy_bandwidth(64 << 20 if profile.interpret else 1 << 30)
    result.set(copy_bandwidth_gbs=copy_bw / 1e9)
    variants = [("bfloat16", None), ("float32", None), ("bfloat16", "int8"), ("bfloat16", "float8_e4m3fn")]
    for dtype_name, pages in variants:
        dtype = jnp.dtype(dtype_name)
        for case in cases:
            q, kp, vp, *rest = kb.make_inputs(case, page_size=k.page_size, dtype=dtype, seed=0, **dims)
            kw: dict[str, Any] = {}
            if pages is not None:
                kp, ks = kv_quant.quantize(kp, pages)
                vp, vs = kv_quant.quantize(vp, pages)
                kw = dict(k_scales=jnp.swapaxes(ks, 1, 2), v_scales=jnp.swapaxes(vs, 1, 2))
            args = (q, kp, vp, *rest)
            scale = k.head_dim ** -0.5
            run_kernel = jax.jit(lambda *x, kw=kw: kernel(*x, sm_scale=scale, **kw, **extra))
            run_ref = jax.jit(lambda *x, kw=kw: reference(*x, sm_scale=scale, **kw))
            t_kernel = kb.time_call(run_kernel, args, k.iters)
            t_ref = kb.time_call(run_ref, args, max(1, k.iters // 4))
            ok, err = kb.compare(run_kernel(*args), run_ref(*args), kb.RTOL[dtype_name])
            itemsize = 1 if pages is not None else dtype.itemsize
            nbytes = kb.bytes_moved(case, itemsize=itemsize, **dims)
            row = dict(case=case.name, dtype=dtype_name, pages=pages or dtype_name, tokens=sum(case.q_lens),
                       kernel_ms=t_kernel * 1e3, reference_ms=t_ref * 1e3, gbs=nbytes / t_kernel / 1e9,
                       pct_copy=100 * nbytes / t_kernel / copy_bw, rel_err=err, ok=ok)
            rows.append(row)
            result.set(attention=rows)
            log(f"attention {case.name} {dtype_name} pages={row['pages']}: {t_kernel * 1e3:.3f} ms "
                f"(reference {t_ref * 1e3:.3f}), rel err {err:.1e} {'ok' if ok else 'MISMATCH'}")
            if not ok:
                failed.append(f"attention {case.name} {dtype_name} pages={row['pages']}: rel err {err:.2e}")
    return failed


def _moe_case(profile: Profile, result: Result) -> list[str]:
    """jaxserve's grouped matmul (tokamax's kernel on TPU/GPU) against jax.lax.ragged_dot."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import kernel_bench as kb
    from jaxserve.model.moe import grouped_matmul

    rows, experts, d, f = profile.kernels.moe
    rng = np.random.default_rng(0)
    sizes = rng.multinomial(rows, np.ones(experts) / experts).astype(np.int32)
    kl, kr = jax.random.split(jax.random.key(0))
    lhs = jax.random.normal(kl, (rows, d), jnp.bfloat16)
    rhs = jax.random.normal(kr, (experts, d, f), jnp.bfloat16) * d ** -0.5
    group_sizes = jnp.asarray(sizes)
    run = jax.jit(grouped_matmul)
    ref = jax.jit(lambda a, b, g: jax.lax.ragged_dot(a, b, g, preferred_element_type=jnp.float32).astype(a.dtype))
    t = kb.time_call(run, (lhs, rhs, group_sizes), profile.kernels.iters)
    t_ref = kb.time_call(ref, (lhs, rhs, group_sizes), profile.kernels.iters)
    ok, err = kb.compare(run(lhs, rhs, group_sizes), ref(lhs, rhs, group_sizes), kb.RTOL["bfloat16"])
    flops = 2 * rows * d * f
    result.set(moe=dict(shape=f"[{rows}, {d}] x [{experts}, {d}, {f}]", kernel_ms=t * 1e3, reference_ms=t_ref * 1e3,
                        tflops=flops / t / 1e12, rel_err=err, ok=ok))
    log(f"grouped matmul: {t * 1e3:.3f} ms ({flops / t / 1e12:.1f} TFLOP/s), ragged_dot {t_ref * 1e3:.3f} ms, "
        f"rel err {err:.1e}")
    return [] if ok else [f"grouped matmul: rel err {err:.2e}"]


# --- serve -----------------------------------------------------------------------------------------

_WARMUP = re.compile(r"warm-up compiled (\d+) programs in ([\d.]+)s")


def stage_serve(profile: Profile, work: Path, result: Result, args: dict) -> None:
    """`jaxserve serve` with its default flags on the profile's model (random weights drawn on the
    device), then a burst from the benchmark client; figures from the client and from /metrics."""
    import bench_serving as bs
    from bench_common import free_port, http_ok, log_tail, stop_process

    deadline = time.monotonic() + float(args.get("seconds", 300))
    directory = model_dir(profile.model, work / "model")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "jaxserve.entrypoints.cli", "serve", "--model", str(directory), "--load-format", "dummy",
           "--port", str(port), "--no-progress", *profile.serve_args]
    result.set(command=" ".join(["jaxserve", *cmd[3:]]))
    server_log = work / "server.log"
    start = time.monotonic()
    with open(server_log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)
    try:
        while not http_ok(f"{url}/health"):
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited ({proc.returncode}):\n{log_tail(server_log)}")
            _warmup_progress(server_log, result)
            if time.monotonic() > deadline - 20:
                raise TimeoutError(f"the server was not ready after {time.monotonic() - start:.0f} s")
            time.sleep(1.0)
        result.set(ready_s=time.monotonic() - start)
        _warmup_progress(server_log, result)
        log(f"server ready in {time.monotonic() - start:.0f} s")
        w = profile.workload
        config = bs.BenchConfig(base_url=url, model=str(directory), tokenizer=str(directory),
                                num_requests=w.num_requests, prompt_len_min=w.prompt_len[0],
                                prompt_len_max=w.prompt_len[1], output_len_min=w.output_len[0],
                                output_len_max=w.output_len[1], prompt_as="ids",
                                timeout=max(10.0, deadline - time.monotonic() - 10))
        report = bs.run_benchmark(config)
        result.set(bench={key: report[key] for key in ("completed", "failed", "errors", "duration_s",
                                                       "total_input_tokens", "total_output_tokens",
                                                       "output_throughput", "total_token_throughput",
                                                       "ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")})
        metrics = scrape(f"{url}/metrics")
        result.set(decode_steps=decode_steps(metrics),
                   compilations_after_warmup=metrics.get("jaxserve:compilations_after_warmup_total"),
                   kv_pages_total=metrics.get("jaxserve:num_kv_pages_total"))
        ok = report["completed"] == w.num_requests and not metrics.get("jaxserve:compilations_after_warmup_total")
        result.set(status="PASS" if ok else "FAIL")
    finally:
        stop_process(proc)
        result.set(server_log_tail=log_tail(server_log, 4000))


def _warmup_progress(server_log: Path, result: Result) -> None:
    text = server_log.read_text(errors="replace") if server_log.exists() else ""
    found = _WARMUP.search(text)
    if found:
        result.set(warmup_programs=int(found.group(1)), warmup_s=float(found.group(2)))
    startup = [line.split("] ", 1)[-1] for line in text.splitlines() if "INFO" in line][:30]
    result.set(server_startup=startup)


def scrape(url: str) -> dict[str, float]:
    """Prometheus text -> 'name{label=value,...}' (model_name dropped) -> value."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=30) as response:  # noqa: S310 (loopback)
        text = response.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def decode_steps(metrics: dict[str, float]) -> list[dict[str, float]]:
    """Per sequence bucket: decode-only steps, mean seconds, mean sequences and mean KV tokens."""
    out = []
    for key, count in metrics.items():
        found = re.fullmatch(r"jaxserve:decode_step_seconds_count\{rows=(\d+)\}", key)
        if not found or not count:
            continue
        label = f"{{rows={found.group(1)}}}"
        out.append(dict(bucket=int(found.group(1)), steps=int(count),
                        step_ms=1e3 * metrics[f"jaxserve:decode_step_seconds_sum{label}"] / count,
                        rows=metrics[f"jaxserve:decode_step_sequences_total{label}"] / count,
                        context_tokens=metrics[f"jaxserve:decode_step_context_tokens_total{label}"] / count))
    return sorted(out, key=lambda d: d["bucket"])


# --- plan ------------------------------------------------------------------------------------------

def stage_plan(profile: Profile, work: Path, result: Result, args: dict) -> None:
    """`jaxserve plan` for the profile's target at the measured decode batch and context (compile-only,
    on the host's CPUs: it can run beside a stage that holds the accelerator)."""
    directory = model_dir(profile.model, work / "plan-model")
    batch, context = int(args["batch"]), int(args["context"])
    out = work / "plan.json"
    # the served engine's flags (the dry run's few buckets; none on an accelerator): the plan predicts
    # the engine the serve stage measured, not a default-sized one it never ran
    cmd = [sys.executable, "-m", "jaxserve.entrypoints.cli", "plan", str(directory), "--target", args.get("target", profile.target),
           "--batch", str(batch), "--context", str(context), "--json", str(out), *profile.serve_args]
    result.set(command=" ".join(["jaxserve", *cmd[3:]]))
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    run = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env)
    if run.returncode != 0:
        raise RuntimeError(f"jaxserve plan failed ({run.returncode}):\n{run.stderr[-3000:]}")
    plan = json.loads(out.read_text())
    steps = {s["what"]: s for s in plan["steps"]}
    decode = steps.get(f"decode b={batch}") or max((s for s in plan["steps"] if s["what"].startswith("decode")),
                                                   key=lambda s: s["batch"])
    result.set(target=plan["target"], settings=plan["settings"], decode=decode,
               prefill=next(s for s in plan["steps"] if s["what"].startswith("prefill")), status="PASS")


STAGES: dict[str, Callable[[Profile, Path, Result, dict], None]] = {
    "env": stage_env, "kernels": stage_kernels, "serve": stage_serve, "plan": stage_plan,
}


def main(argv: list[str]) -> int:
    stage, profile_path, work, result_path = argv[:4]
    args = json.loads(argv[4]) if len(argv) > 4 else {}
    profile = Profile.from_json(json.loads(Path(profile_path).read_text()))
    work = Path(work)
    work.mkdir(parents=True, exist_ok=True)
    result = Result(Path(result_path))
    if stage == "peer":
        from device_peer import stage_peer as run
    elif stage == "features":
        from device_features import stage_features as run
    else:
        run = STAGES[stage]
    try:
        run(profile, work, result, args)
    except Exception as e:  # noqa: BLE001 — the stage's failure is its result
        traceback.print_exc()
        result.set(status="FAIL", error=f"{type(e).__name__}: {e}"[:4000])
        return 1
    finally:
        result.set(peak_rss_mib=peak_rss_mib())
    return 0


def peak_rss_mib() -> float:
    """The most host memory this stage or any child it waited for (the served engine) held at once."""
    import resource

    return max(resource.getrusage(who).ru_maxrss for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)) / 1024


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
