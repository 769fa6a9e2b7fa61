"""Cold and warm start of `jaxserve serve` with its defaults: seconds from launch until /health is 200.

Cold: a fresh, empty compilation cache directory (every program compiles). Warm: the same
directory again (every program loads from it). Runs alternate cold, warm, cold, warm, ... and the
medians are reported, with the server's own "warm-up compiled N programs in X s" figure.

    python scripts/bench_startup.py                          # the embedded default model
    python scripts/bench_startup.py --model-preset bench-105m --repeats 2
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common as bc  # noqa: E402

WARMUP_LINE = re.compile(r"warm-up compiled (\d+) programs in ([0-9.]+)s")


def start_once(model: str | None, cache_dir: Path, log_path: Path, timeout: float) -> dict[str, float]:
    """Launches `jaxserve serve` (defaults, plus the cache dir), waits for /health, stops it."""
    port = bc.free_port()
    cmd = [bc.python_cmd(), "-m", "jaxserve.entrypoints.cli", "serve", "--port", str(port), "--no-progress",
           "--compilation-cache-dir", str(cache_dir)] + (["--model", model] if model else [])
    t0 = time.monotonic()
    with bc.server_process(cmd, f"http://127.0.0.1:{port}/health", log_path, timeout):
        ready = time.monotonic() - t0
    match = WARMUP_LINE.search(log_path.read_text(errors="replace"))
    programs, warmup = (int(match.group(1)), float(match.group(2))) if match else (0, float("nan"))
    return {"ready_s": ready, "warmup_s": warmup, "programs": programs}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model dir or cached hub id (default: the embedded model)")
    p.add_argument("--model-preset", default=None, help="a scripts/bench_vs_peers.py preset (bench-small, ...)")
    p.add_argument("--repeats", type=int, default=2, help="cold/warm pairs")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds one start may take")
    a = p.parse_args(argv)
    model = a.model
    if a.model_preset:
        import bench_vs_peers

        model = str(bench_vs_peers.ensure_preset(a.model_preset))
    runs: dict[str, list[dict[str, float]]] = {"cold": [], "warm": []}
    with tempfile.TemporaryDirectory(prefix="jaxserve-startup-") as tmp:
        for i in range(a.repeats):
            cache = Path(tmp) / f"xla-{i}"
            for kind in ("cold", "warm"):
                run = start_once(model, cache, Path(tmp) / f"{kind}-{i}.log", a.timeout)
                runs[kind].append(run)
                print(f"{kind} {i}: ready in {run['ready_s']:.1f} s (warm-up {run['warmup_s']:.1f} s, "
                      f"{run['programs']} programs)", flush=True)
    info = bc.machine_info()
    print(f"\nmodel {model or 'jaxserve-tiny'} | CPU {info.get('cpu')} | jax {info.get('jax')}")
    for kind, rs in runs.items():
        print(f"{kind}: ready {bc.median([r['ready_s'] for r in rs]):.1f} s median of {len(rs)}, warm-up "
              f"{bc.median([r['warmup_s'] for r in rs]):.1f} s, {rs[0]['programs']} programs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
