"""TTFT and throughput of jaxserve under request bursts, for its defaults and other flag sets.

Each configuration is one `jaxserve serve` process; every burst size is sent to it (all requests
at t=0, prompts and output lengths drawn as in bench_vs_peers), repeats interleave the
configurations, and medians are reported. The point is the tail: a burst larger than
max-num-seqs must not leave late arrivals waiting for earlier requests to finish.

    python scripts/bench_bursts.py --model-preset bench-small --bursts 64,256 \
        --config defaults= --config "old defaults=--max-num-seqs 16 --max-num-batched-tokens 256 \
        --kv-cache-memory 256MiB --max-model-len 2048 --token-buckets 16,64,256 --seq-buckets 16"
"""

from __future__ import annotations

import argparse
import contextlib
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common as bc  # noqa: E402
import bench_serving as bs  # noqa: E402
import bench_vs_peers as bvp  # noqa: E402


def parse_config(text: str) -> tuple[str, str]:
    """'name=flags' -> (name, flags); flags may be empty (jaxserve's defaults)."""
    name, sep, flags = text.partition("=")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(f"--config wants NAME=FLAGS, got {text!r}")
    return name.strip(), flags.strip()


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [f"- model: `{meta['model']}`; prompts {meta['prompts']} tokens, outputs {meta['outputs']} tokens "
             f"(EOS ignored, greedy), all requests at t=0; medians of {meta['repeats']} interleaved repeats",
             "", "| configuration | burst | output tok/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | E2E p99 ms | failed |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['config']} | {r['burst']} | {r['tok_s']:.1f} | {r['ttft_p50']:.0f} | {r['ttft_p99']:.0f} | "
                     f"{r['tpot_p50']:.1f} | {r['e2e_p99']:.0f} | {r['failed']} |")
    lines += ["", "Flags: " + "; ".join(f"{n}: `{f or '(none)'}`" for n, f in meta["configs"]),
              "", f"Machine: {meta['machine']}", "", f"Command: `{meta['command']}`"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-preset", default="bench-small", choices=sorted(bvp.PRESETS))
    p.add_argument("--bursts", default="64,256", help="burst sizes, comma-separated")
    p.add_argument("--config", type=parse_config, action="append", default=None,
                   help="NAME=FLAGS for `jaxserve serve` (repeatable; default: defaults=)")
    p.add_argument("--prompt-len-min", type=int, default=30)
    p.add_argument("--prompt-len-max", type=int, default=500)
    p.add_argument("--output-len-min", type=int, default=16)
    p.add_argument("--output-len-max", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--log-dir", type=Path, default=Path("/tmp/jaxserve-bursts"))
    p.add_argument("--docs", type=Path, default=bc.REPO_ROOT / "docs" / "BENCHMARKS.md")
    p.add_argument("--no-docs", action="store_true")
    a = p.parse_args(argv)
    configs = a.config or [("defaults", "")]
    bursts = [int(b) for b in a.bursts.split(",")]
    model_dir = bvp.ensure_preset(a.model_preset)
    tokenizer = bs.load_tokenizer(str(model_dir))
    results: dict[tuple[str, int], list[dict]] = {}
    for rep in range(a.repeats):
        for name, flags in configs:
            port = bc.free_port()
            cmd = bvp.jaxserve_command(model_dir, port, extra_args=flags)
            log = a.log_dir / f"{name.replace(' ', '_')}-{rep}.log"
            with contextlib.ExitStack() as stack:
                stack.enter_context(bc.server_process(cmd, f"http://127.0.0.1:{port}/health", log, 900.0))
                for n in bursts:
                    cfg = bs.BenchConfig(base_url=f"http://127.0.0.1:{port}", model=str(model_dir), num_requests=n,
                                         prompt_len_min=a.prompt_len_min, prompt_len_max=a.prompt_len_max,
                                         output_len_min=a.output_len_min, output_len_max=a.output_len_max,
                                         timeout=a.timeout, seed=rep)
                    report = bs.run_benchmark(cfg, tokenizer=tokenizer)
                    results.setdefault((name, n), []).append(report)
                    print(f"[repeat {rep + 1}/{a.repeats}] {name} burst {n}: {report['output_throughput']:.1f} tok/s, "
                          f"TTFT p50 {report['ttft_ms']['p50']:.0f} p99 {report['ttft_ms']['p99']:.0f} ms, "
                          f"failed {report['failed']}", flush=True)
    rows = []
    for (name, n), reports in results.items():
        rows.append({"config": name, "burst": n,
                     "tok_s": bc.median([r["output_throughput"] for r in reports]),
                     "ttft_p50": bc.median([r["ttft_ms"]["p50"] for r in reports]),
                     "ttft_p99": bc.median([r["ttft_ms"]["p99"] for r in reports]),
                     "tpot_p50": bc.median([r["tpot_ms"]["p50"] for r in reports]),
                     "e2e_p99": bc.median([r["e2e_ms"]["p99"] for r in reports]),
                     "failed": sum(r["failed"] for r in reports)})
    info = bc.machine_info()
    meta = {"model": a.model_preset, "prompts": f"{a.prompt_len_min}-{a.prompt_len_max}",
            "outputs": f"{a.output_len_min}-{a.output_len_max}", "repeats": a.repeats, "configs": configs,
            "machine": ", ".join(f"{k} {v}" for k, v in info.items()),
            "command": "python scripts/bench_bursts.py " + shlex.join(argv if argv is not None else sys.argv[1:])}
    body = markdown(rows, meta)
    print(body)
    if not a.no_docs:
        bc.replace_marked_section(a.docs, "<!-- bench_bursts:start -->", "<!-- bench_bursts:end -->",
                                  body, "# jaxserve benchmarks")
    return 0


if __name__ == "__main__":
    sys.exit(main())
