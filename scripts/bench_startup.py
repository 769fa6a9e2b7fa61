"""Cold and warm start of `jaxserve serve` with its defaults, as a new user meets them.

Per start: seconds from launch until /health answers 200 (ready), until the first token of a first
request sent right then (first token), and until every declared program is compiled (all compiled:
/health's programs_compiled == programs_declared; the default background warm-up serves before
that). Cold: a fresh, empty XDG_CACHE_HOME (the embedded model is written, the native CPU kernel
built, every program compiled); warm: the same directory again. Runs alternate cold, warm, cold,
warm, ... (or N warm starts after each cold one: --warm-per-cold N) and medians are reported.

    python scripts/bench_startup.py                                    # the embedded default model
    python scripts/bench_startup.py --model-preset bench-105m --repeats 1
    python scripts/bench_startup.py --flags "--quantization int8 --kv-cache-dtype int8 --speculative-config ngram"
    python scripts/bench_startup.py --flags "--warmup full"            # every program before ready
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common as bc  # noqa: E402

NGRAM = '{"method": "ngram", "num_speculative_tokens": 3}'


def _flags(text: str) -> list[str]:
    """--flags text -> argv; `--speculative-config ngram` is short for an n-gram config."""
    argv = shlex.split(text)
    return [NGRAM if a == "ngram" and i and argv[i - 1] == "--speculative-config" else a for i, a in enumerate(argv)]


def first_token_seconds(url: str, model: str) -> float:
    """Seconds until the first streamed token of a short greedy completion."""
    t0 = time.monotonic()
    body = {"model": model, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0,
            "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                return time.monotonic() - t0
    raise RuntimeError("the stream ended without a token")


def start_once(model: str | None, flags: list[str], xdg: Path, log_path: Path, timeout: float) -> dict:
    """Launches `jaxserve serve` (defaults + flags, caches under `xdg`), waits for /health, sends a
    first request, waits until every program is compiled, stops it."""
    port = bc.free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [bc.python_cmd(), "-m", "jaxserve.entrypoints.cli", "serve", "--port", str(port), "--no-progress",
           *flags] + (["--model", model] if model else [])
    # both cache roots: jax's and the programs' (XDG_CACHE_HOME), the embedded model's and the native
    # kernel's (JAXSERVE_CACHE), so a cold start meets what a fresh machine does
    env = {**os.environ, "XDG_CACHE_HOME": str(xdg), "JAXSERVE_CACHE": str(xdg / "jaxserve")}
    t0 = time.monotonic()
    with bc.server_process(cmd, f"{url}/health", log_path, timeout, env=env):
        ready = time.monotonic() - t0
        served = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        first = ready + first_token_seconds(url, served)
        while True:
            health = httpx.get(f"{url}/health", timeout=10).json()
            if health["programs_compiled"] >= health["programs_declared"]:
                break
            if time.monotonic() - t0 > timeout:
                raise RuntimeError(f"programs still compiling after {timeout:.0f} s: {health}")
            time.sleep(0.25)
        compiled = time.monotonic() - t0
    return {"ready_s": ready, "first_token_s": first, "all_compiled_s": compiled,
            "programs": health["programs_declared"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model dir or cached hub id (default: the embedded model)")
    p.add_argument("--model-preset", default=None, help="a scripts/bench_vs_peers.py preset (bench-105m, ...)")
    p.add_argument("--flags", default="", help="more `jaxserve serve` flags, one string")
    p.add_argument("--repeats", type=int, default=2, help="cold starts, each followed by its warm ones")
    p.add_argument("--warm-per-cold", type=int, default=1, help="warm starts after each cold one (same cache)")
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds one start may take")
    a = p.parse_args(argv)
    model = a.model
    if a.model_preset:
        import bench_vs_peers

        model = str(bench_vs_peers.ensure_preset(a.model_preset))
    flags = _flags(a.flags)
    runs: dict[str, list[dict]] = {"cold": [], "warm": []}
    with tempfile.TemporaryDirectory(prefix="jaxserve-startup-") as tmp:
        for i in range(a.repeats):
            xdg = Path(tmp) / f"xdg-{i}"
            for j, kind in enumerate(["cold"] + ["warm"] * a.warm_per_cold):
                run = start_once(model, flags, xdg, Path(tmp) / f"{kind}-{i}-{j}.log", a.timeout)
                runs[kind].append(run)
                print(f"{kind} {i}: ready {run['ready_s']:.1f} s, first token {run['first_token_s']:.1f} s, "
                      f"all {run['programs']} programs compiled {run['all_compiled_s']:.1f} s", flush=True)
    info = bc.machine_info()
    print(f"\nmodel {model or 'jaxserve-tiny'} {' '.join(flags)} | CPU {info.get('cpu')} | jax {info.get('jax')}")
    for kind, rs in runs.items():
        med = {k: bc.median([r[k] for r in rs]) for k in ("ready_s", "first_token_s", "all_compiled_s")}
        print(f"{kind} (median of {len(rs)}): ready {med['ready_s']:.1f} s, first token {med['first_token_s']:.1f} s, "
              f"all compiled {med['all_compiled_s']:.1f} s ({rs[0]['programs']} programs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
