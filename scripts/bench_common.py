"""Helpers shared by the benchmark scripts: statistics, machine facts, subprocess servers, docs markers.

Nothing here imports jax or torch at module level, so the load generator stays light.
"""
from __future__ import annotations

import contextlib
import importlib.metadata
import math
import os
import platform
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Iterator, Sequence

REPO_ROOT = Path(__file__).resolve().parent.parent


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default method); NaN for an empty input.

    Position of the q-th percentile in the sorted list is (n - 1) * q / 100; between two
    neighbours the value is interpolated linearly.
    """
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    if len(values) == 0:
        return math.nan
    xs = sorted(float(v) for v in values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    frac = pos - lo
    return xs[lo] + (xs[hi] - xs[lo]) * frac


def summarize(values: Sequence[float], scale: float = 1.0) -> dict[str, float]:
    """mean / p50 / p95 / p99 / max of `values` multiplied by `scale` (e.g. 1000 for s -> ms)."""
    if len(values) == 0:
        return {"mean": math.nan, "p50": math.nan, "p95": math.nan, "p99": math.nan, "max": math.nan}
    scaled = [float(v) * scale for v in values]
    return {
        "mean": sum(scaled) / len(scaled),
        "p50": percentile(scaled, 50),
        "p95": percentile(scaled, 95),
        "p99": percentile(scaled, 99),
        "max": max(scaled),
    }


def median(values: Sequence[float]) -> float:
    finite = [v for v in values if v is not None and not math.isnan(v)]
    return percentile(finite, 50) if finite else math.nan


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info() -> dict[str, str]:
    """Facts a reader needs to judge a benchmark number (no jax import: versions from metadata)."""
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "cpu": cpu_model(),
        "cores": f"{os.cpu_count()} logical ({affinity} usable)",
        "os": platform.platform(),
        "python": platform.python_version(),
        "jax": _version("jax"),
        "jaxlib": _version("jaxlib"),
        "torch": _version("torch"),
        "transformers": _version("transformers"),
    }


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def http_ok(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 (loopback only)
            return resp.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return False


def log_tail(path: Path, n_chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-n_chars:]
    except OSError:
        return ""


@contextlib.contextmanager
def server_process(
    cmd: list[str], health_url: str, log_path: Path, start_timeout: float, env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen]:
    """Start `cmd`, wait until GET `health_url` answers 200, yield the process, stop it on exit.

    Raises RuntimeError (with the log tail) when the process dies or never becomes healthy.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log = open(log_path, "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + start_timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"server exited with code {proc.returncode} before becoming healthy: {' '.join(cmd)}\n"
                    f"--- log tail ---\n{log_tail(log_path)}"
                )
            if http_ok(health_url):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"server not healthy after {start_timeout:.0f} s: {' '.join(cmd)}\n"
                    f"--- log tail ---\n{log_tail(log_path)}"
                )
            time.sleep(0.5)
        yield proc
    finally:
        stop_process(proc)
        log.close()


def stop_process(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """SIGTERM the process we started, then SIGKILL it if it lingers."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=grace)


def replace_marked_section(path: Path, start_marker: str, end_marker: str, body: str, header: str) -> None:
    """Write `body` between the two markers of `path`, leaving every other byte untouched.

    A missing file is created with `header`; a file without the markers gets the section appended.
    """
    block = f"{start_marker}\n{body.rstrip()}\n{end_marker}"
    if path.exists():
        text = path.read_text()
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        text = header.rstrip() + "\n"
    start = text.find(start_marker)
    end = text.find(end_marker)
    if (start == -1) != (end == -1) or (start != -1 and end < start):
        raise ValueError(f"{path}: markers {start_marker!r} / {end_marker!r} are unbalanced; fix the file by hand")
    if start == -1:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    else:
        text = text[:start] + block + text[end + len(end_marker):]
    path.write_text(text)


def python_cmd() -> str:
    return sys.executable


def run_requests(core, requests: Sequence) -> dict[str, float]:
    """Adds `requests` to an EngineCore at once and steps it until idle: output tokens/s over the
    wall time and the median over requests of TPOT ((last token - first) / (tokens - 1)), in ms,
    from the engine's own step loop (no HTTP)."""
    for r in requests:
        core.add_request(r)
    times: dict[str, list[float]] = {}
    t0 = time.perf_counter()
    while core.has_work():
        events = core.step()
        now = time.perf_counter()
        for e in events:
            if e.token_id is not None:
                times.setdefault(e.request_id, []).append(now)
    wall = time.perf_counter() - t0
    tpots = [(t[-1] - t[0]) / (len(t) - 1) for t in times.values() if len(t) > 1]
    return {"tokens_per_s": sum(map(len, times.values())) / wall, "tpot_ms": median(tpots) * 1e3}


def engine_run_args(ap, prompt_len: int = 128, max_tokens: int = 128, repeats: int = 3) -> None:
    """The flags of an engine-loop benchmark's workload (bench_spec, bench_lora)."""
    ap.add_argument("--prompt-len", type=int, default=prompt_len, help="random prompt tokens per request")
    ap.add_argument("--max-tokens", type=int, default=max_tokens, help="output tokens per request")
    ap.add_argument("--repeats", type=int, default=repeats, help="interleaved repeats; the median is reported")
    ap.add_argument("--json-out", help="write the rows as JSON here")
