"""Does the served path keep up with the engine? Many concurrent SSE streams on a model whose
device work is small, inter-token latency against the engine's own decode step time.

    python scripts/bench_streams.py                    # 256 streams, 64 tokens each
    python scripts/bench_streams.py --streams 64 --output-len 128

A micro model (Qwen3 architecture, hidden 32, one layer, the real Qwen tokenizer of the embedded
model, so its 151,936-token vocabulary) is written once under --cache-dir; `jaxserve serve` runs it
with its defaults plus `--warmup full` (every bucket compiled before the burst: a compile would not
be the host path's doing); scripts/bench_serving.py sends `--streams` requests at once (greedy,
prompts as ids, every output to its length). Reported: the inter-token latency (ITL) between a
stream's chunks (p50 / p99) and the engine's mean decode step time at the largest batch bucket the
burst ran (jaxserve:decode_step_seconds from /metrics). The host path keeps up when ITL p99 stays
within 2x of that step time: every step's tokens reach every client before the next ones.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common as bc  # noqa: E402
import bench_serving  # noqa: E402

MICRO = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
         "num_key_value_heads": 1, "head_dim": 16}


def micro_model(cache: Path) -> Path:
    """The micro model dir: the embedded model's config with MICRO's sizes, its tokenizer files."""
    from safetensors.numpy import save_file

    from jaxserve.default_model import CONFIG, ensure_default_model, random_weights

    out = cache / "micro-streams"
    if (out / "model.safetensors").exists():
        return out
    src = Path(ensure_default_model())
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name.startswith("tokenizer") or f.name in ("vocab.json", "merges.txt", "special_tokens_map.json",
                                                         "generation_config.json"):
            shutil.copy2(f, out / f.name)
    cfg = {**CONFIG, **MICRO}
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file(random_weights(cfg), str(out / "model.safetensors.tmp"), metadata={"format": "pt"})
    (out / "model.safetensors.tmp").rename(out / "model.safetensors")
    return out


def decode_step_ms(url: str) -> tuple[int, float]:
    """(largest sequence bucket with decode-only steps, its mean step time in ms) from /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    sums, counts = {}, {}
    for name, rows, value in re.findall(r'jaxserve:decode_step_seconds_(sum|count)\{[^}]*rows="(\d+)"[^}]*\} (\S+)',
                                        text):
        (sums if name == "sum" else counts)[int(rows)] = float(value)
    bucket = max(b for b, c in counts.items() if c > 0)
    return bucket, sums[bucket] / counts[bucket] * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "jaxserve-bench"))
    ap.add_argument("--flags", default="", help="more `jaxserve serve` flags")
    a = ap.parse_args(argv)
    model = micro_model(Path(a.cache_dir))
    port = bc.free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [bc.python_cmd(), "-m", "jaxserve.entrypoints.cli", "serve", "--model", str(model), "--port", str(port),
           "--no-progress", "--warmup", "full", "--disable-log-requests", *a.flags.split()]
    with bc.server_process(cmd, f"{url}/health", Path(a.cache_dir) / "bench_streams.log", 1200):
        served = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        report = bench_serving.run_benchmark(bench_serving.BenchConfig(
            base_url=url, model=served, tokenizer=str(model), num_requests=a.streams,
            prompt_len_min=a.prompt_len, prompt_len_max=a.prompt_len, output_len_min=a.output_len,
            output_len_max=a.output_len))
        bucket, step_ms = decode_step_ms(url)
    itl = report["itl_ms"]
    info = bc.machine_info()
    print(json.dumps({"streams": a.streams, "completed": report.get("completed"), "itl_ms": itl,
                      "decode_step_ms": step_ms, "bucket": bucket}, indent=1))
    print(f"CPU {info.get('cpu')} | jax {info.get('jax')}")
    print(f"{a.streams} streams x {a.output_len} tokens: ITL p50 {itl['p50']:.1f} ms, p99 {itl['p99']:.1f} ms; "
          f"decode step at {bucket} rows {step_ms:.1f} ms; p99 / step = {itl['p99'] / step_ms:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
