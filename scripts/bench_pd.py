"""Inter-token latency of decode streams while long prompts arrive: one colocated `jaxserve serve`
against `jaxserve serve --disaggregate 1:1` (a prefill and a decode instance behind the PD proxy),
the same offered load, the same machine, interleaved repeats.

    python scripts/bench_pd.py --model bench-105m --repeats 2

Each run: --streams streaming requests (short prompts, 96 output tokens) start together; every
--gap seconds one long prompt (--long-tokens random token ids, 8 output tokens) arrives. ITL = the gaps between
a stream's successive chunks; p50/p99 over every stream's gaps. Both setups run with their defaults
on every core of this process: the colocated server uses all of them, the two PD instances a
disjoint half each (what `--disaggregate` does on a CPU).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
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
from bench_vs_peers import PRESETS, ensure_preset  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(args: list[str], port: int) -> subprocess.Popen:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.Popen([sys.executable, "-m", "jaxserve.entrypoints.cli", *args, "--port", str(port)], cwd=ROOT, env=env,
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


async def stream(client: httpx.AsyncClient, url: str, model: str, prompt: str | list[int],
                 max_tokens: int) -> list[float]:
    times = []
    async with client.stream("POST", url + "/v1/completions", json={
            "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: {r.status_code} {(await r.aread()).decode()[:300]}")
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                times.append(time.perf_counter())
    return [b - a for a, b in zip(times, times[1:])]


async def workload(url: str, streams: int, longs: int, long_tokens: int, gap: float) -> dict:
    async with httpx.AsyncClient(timeout=600) as client:
        model = (await client.get(url + "/v1/models")).json()["data"][0]["id"]
        decodes = [asyncio.create_task(stream(client, url, model, f"stream {i}: tell me a story", 96))
                   for i in range(streams)]
        longs_done = []
        for k in range(longs):
            await asyncio.sleep(gap)
            ids = random.Random(k).choices(range(1000, 100_000), k=long_tokens)  # no prefix shared
            longs_done.append(asyncio.create_task(stream(client, url, model, ids, 8)))
        gaps = [g for t in await asyncio.gather(*decodes) for g in t]
        await asyncio.gather(*longs_done)
    q = statistics.quantiles(gaps, n=100)
    return {"itl_p50_ms": round(statistics.median(gaps) * 1e3, 1), "itl_p99_ms": round(q[98] * 1e3, 1),
            "gaps": len(gaps)}


def run(flags: list[str], args: argparse.Namespace) -> dict:
    """One server started with `serve FLAGS`, the workload once, the server stopped."""
    port = free_port()
    for p in range(port + 1, port + 3):  # --disaggregate puts its instances on the next two ports
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", p)) == 0:
                raise RuntimeError(f"port {p} is taken; run again")
    proc = start(["serve", "--no-access-log", *flags], port)
    try:
        wait(f"http://127.0.0.1:{port}")
        return asyncio.run(workload(f"http://127.0.0.1:{port}", args.streams, args.long_prompts, args.long_tokens,
                                    args.gap))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help=f"a model dir or a preset ({', '.join(PRESETS)}); default: the "
                                                  "embedded model")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--long-prompts", type=int, default=6)
    ap.add_argument("--long-tokens", type=int, default=1500, help="tokens of each long prompt")
    ap.add_argument("--gap", type=float, default=0.5)
    ap.add_argument("--repeats", type=int, default=1, help="interleaved runs of each setup")
    ap.add_argument("--kv-transport", choices=("http", "jax"), default="http", help="the PD instances' transport")
    args = ap.parse_args()
    model = []
    if args.model:
        model = ["--model", str(ensure_preset(args.model) if args.model in PRESETS else args.model)]
    setups = {"colocated": model, "disaggregated": [*model, "--disaggregate", "1:1", "--kv-transport", args.kv_transport]}
    out: dict = {"cpu": cpu_model(), "cores": len(os.sched_getaffinity(0)), "model": args.model or "embedded",
                 "kv_transport": args.kv_transport}
    for r in range(args.repeats):
        for name, flags in setups.items():
            out.setdefault(name, []).append(run(flags, args))
            print(name, r, out[name][-1], file=sys.stderr, flush=True)
    for name in setups:
        out[f"{name}_itl_p99_ms_median"] = statistics.median(x["itl_p99_ms"] for x in out[name])
    out["itl_p99_ratio_colocated_over_pd"] = round(out["colocated_itl_p99_ms_median"]
                                                   / out["disaggregated_itl_p99_ms_median"], 2)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
