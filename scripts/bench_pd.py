"""Inter-token latency of decode streams while long prompts arrive: one colocated server against a
prefill instance + a decode instance behind `jaxserve proxy`, the same offered load, one run.

    python scripts/bench_pd.py --streams 8 --long-prompts 6

Each setup: --streams streaming requests (short prompts, 96 output tokens) start together; every
--gap seconds one long prompt (--long-tokens words, 8 output tokens) arrives. ITL = the gaps between
a stream's successive chunks; p50/p99 over every stream's gaps. The servers run the embedded model
with their defaults (each PD instance is a process of its own on the same cores).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from bench_common import cpu_model  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(args: list[str], port: int) -> subprocess.Popen:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.Popen([sys.executable, "-m", "jaxserve.cli", *args, "--port", str(port)], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def wait(url: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(url)


async def stream(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int) -> list[float]:
    times = []
    async with client.stream("POST", url + "/v1/completions", json={
            "model": "jaxserve-tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                times.append(time.perf_counter())
    return [b - a for a, b in zip(times, times[1:])]


async def workload(url: str, streams: int, longs: int, long_words: int, gap: float) -> dict:
    async with httpx.AsyncClient(timeout=600) as client:
        decodes = [asyncio.create_task(stream(client, url, f"stream {i}: tell me a story", 96))
                   for i in range(streams)]
        longs_done = []
        for k in range(longs):
            await asyncio.sleep(gap)
            words = " ".join(f"w{k}x{j}" for j in range(long_words))
            longs_done.append(asyncio.create_task(stream(client, url, words, 8)))
        gaps = [g for t in await asyncio.gather(*decodes) for g in t]
        await asyncio.gather(*longs_done)
    q = statistics.quantiles(gaps, n=100)
    return {"itl_p50_ms": round(statistics.median(gaps) * 1e3, 1), "itl_p99_ms": round(q[98] * 1e3, 1),
            "gaps": len(gaps)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--long-prompts", type=int, default=6)
    ap.add_argument("--long-tokens", type=int, default=700, help="words of each long prompt (~2 tokens each)")
    ap.add_argument("--gap", type=float, default=0.5)
    args = ap.parse_args()
    out = {"cpu": cpu_model()}
    procs = []
    try:
        port = free_port()
        procs.append(start(["serve", "--no-access-log"], port))
        wait(f"http://127.0.0.1:{port}")
        out["colocated"] = asyncio.run(workload(f"http://127.0.0.1:{port}", args.streams, args.long_prompts,
                                                args.long_tokens, args.gap))
        procs.pop().send_signal(signal.SIGTERM)
        p, d, x = free_port(), free_port(), free_port()
        procs += [start(["serve", "--kv-role", "prefill", "--no-access-log"], p),
                  start(["serve", "--kv-role", "decode", "--no-access-log"], d)]
        wait(f"http://127.0.0.1:{p}")
        wait(f"http://127.0.0.1:{d}")
        procs.append(start(["proxy", "--prefill", f"http://127.0.0.1:{p}", "--decode", f"http://127.0.0.1:{d}"], x))
        wait(f"http://127.0.0.1:{x}")
        out["disaggregated"] = asyncio.run(workload(f"http://127.0.0.1:{x}", args.streams, args.long_prompts,
                                                    args.long_tokens, args.gap))
        out["itl_p99_ratio_colocated_over_pd"] = round(out["colocated"]["itl_p99_ms"]
                                                       / out["disaggregated"]["itl_p99_ms"], 2)
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            proc.wait(60)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
