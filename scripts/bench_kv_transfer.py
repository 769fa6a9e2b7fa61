"""PD disaggregation's KV transfer, per transport: one prefill instance and two decode instances of
the same model (`--kv-transport http`: the pages' bytes over HTTP; `--kv-transport jax`: pulled over
jax.experimental.transfer), each its own process.

    python scripts/bench_kv_transfer.py --prompts 5 --words 700

Each prompt (--words random words) is prefilled once on the prefill instance, then sent to each
decode instance with max_tokens 1 and kv_transfer_params naming the prefill instance, so each
decode instance fetches and imports the prompt's pages. The decode instances log every transfer
("KV transfer (<transport>): N pages (M MiB) from URL in T ms"); the medians are reported.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import re
import statistics
import sys
import tempfile
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from bench_common import cpu_model, free_port, python_cmd, server_process  # noqa: E402

LOG_LINE = re.compile(r"KV transfer \((\w+)\): (\d+) pages \(([\d.]+) MiB\) from \S+ in ([\d.]+) ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=5)
    ap.add_argument("--words", type=int, default=700, help="random words per prompt (~2 tokens each)")
    ap.add_argument("--model", default=None, help="model directory (default: the embedded model)")
    args = ap.parse_args()
    model = ["--model", args.model] if args.model else []
    rng = random.Random(0)
    vocabulary = [f"w{i}" for i in range(5000)]
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        urls, logs = {}, {}
        for name, flags in (("prefill", ["--kv-role", "prefill"]),
                            ("http", ["--kv-role", "decode", "--kv-transport", "http"]),
                            ("jax", ["--kv-role", "decode", "--kv-transport", "jax"])):
            port = free_port()
            urls[name], logs[name] = f"http://127.0.0.1:{port}", Path(tmp) / f"{name}.log"
            cmd = [python_cmd(), "-m", "jaxserve.entrypoints.cli", "serve", *model, *flags, "--port", str(port),
                   "--no-progress", "--no-access-log", "--max-model-len", "4096"]
            stack.enter_context(server_process(cmd, urls[name] + "/health", logs[name], 600))
        model_id = httpx.get(urls["prefill"] + "/v1/models").json()["data"][0]["id"]
        for i in range(args.prompts):
            prompt = " ".join(rng.choice(vocabulary) for _ in range(args.words))
            body = {"model": model_id, "prompt": prompt, "max_tokens": 1}
            httpx.post(urls["prefill"] + "/v1/completions", json=body, timeout=600).raise_for_status()
            for transport in ("http", "jax"):
                r = httpx.post(urls[transport] + "/v1/completions", timeout=600,
                               json={**body, "kv_transfer_params": {"remote_url": urls["prefill"]}})
                r.raise_for_status()
        out = {"cpu": cpu_model(), "prompts": args.prompts, "words": args.words}
        for transport in ("http", "jax"):
            rows = [(int(p), float(mib), float(ms)) for t, p, mib, ms in LOG_LINE.findall(logs[transport].read_text())
                    if t == transport]
            out[transport] = {"transfers": len(rows), "pages": statistics.median(p for p, _, _ in rows),
                              "mib": statistics.median(m for _, m, _ in rows),
                              "ms": round(statistics.median(ms for _, _, ms in rows), 1),
                              "mib_per_s": round(statistics.median(m / (ms / 1e3) for _, m, ms in rows), 1)}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
