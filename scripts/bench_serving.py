"""Load generator for any OpenAI-compatible streaming server (jaxserve, vLLM, `transformers serve`, ...).

    python scripts/bench_serving.py --base-url http://127.0.0.1:8000 --model m --tokenizer DIR \
        --num-requests 64 --request-rate 4 --prompt-len-min 64 --prompt-len-max 512 \
        --output-len-min 64 --output-len-max 128 --json-out out.json --plot plots/

Per request it measures TTFT (send -> first non-empty text chunk), the inter-token latencies between
text chunks (ITL), TPOT = (e2e - ttft) / (n_out - 1), end-to-end latency, and the number of output
tokens (`usage.completion_tokens` when the server sends usage, else the number of text chunks).
`run_benchmark(BenchConfig) -> dict` is the reusable entry point.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib.util
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Sequence

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import REPO_ROOT, summarize  # noqa: E402

LengthControl = Literal["ignore_eos", "hf_generation_config", "none"]


@dataclass
class BenchConfig:
    base_url: str
    model: str
    tokenizer: str | None = None          # local tokenizer dir; None => `model` (must then be a dir)
    endpoint: Literal["completions", "chat"] = "completions"
    num_requests: int = 64
    request_rate: float = math.inf        # Poisson arrivals, req/s; inf => all at t=0
    max_concurrency: int | None = None    # at most this many requests in flight
    prompt_len_min: int = 64
    prompt_len_max: int = 256
    output_len_min: int = 64
    output_len_max: int = 64
    prompt_as: Literal["text", "ids"] = "ids"
    seed: int = 0
    timeout: float = 600.0                # global wall-clock bound for the whole run, seconds
    slo_ttft_ms: float = 2000.0
    slo_tpot_ms: float = 200.0
    temperature: float = 0.0
    include_usage: bool = True            # stream_options.include_usage
    # How the exact output length is forced: vLLM-style `ignore_eos`, the `generation_config`
    # JSON field of `transformers serve` (min_new_tokens = max_new_tokens), or nothing.
    length_control: LengthControl = "ignore_eos"
    extra_body: dict[str, Any] = field(default_factory=dict)
    corpus: str | None = None             # file or dir of .md/.py text; None => this repository
    corpus_max_chars: int = 400_000
    api_key: str | None = None
    json_out: str | None = None
    plot_dir: str | None = None

    def validate(self) -> None:
        if self.endpoint not in ("completions", "chat"):
            raise ValueError(f"endpoint must be 'completions' or 'chat', got {self.endpoint!r}")
        if self.prompt_as not in ("text", "ids"):
            raise ValueError(f"prompt_as must be 'text' or 'ids', got {self.prompt_as!r}")
        if self.endpoint == "chat" and self.prompt_as == "ids":
            raise ValueError("prompt_as='ids' needs endpoint='completions' (chat messages are text)")
        if self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be > 0 (inf for a burst), got {self.request_rate}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if not 1 <= self.prompt_len_min <= self.prompt_len_max:
            raise ValueError(f"need 1 <= prompt_len_min <= prompt_len_max, got {self.prompt_len_min}, {self.prompt_len_max}")
        if not 1 <= self.output_len_min <= self.output_len_max:
            raise ValueError(f"need 1 <= output_len_min <= output_len_max, got {self.output_len_min}, {self.output_len_max}")
        if not self.timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {self.timeout}")
        if self.length_control not in ("ignore_eos", "hf_generation_config", "none"):
            raise ValueError(f"unknown length_control {self.length_control!r}")


@dataclass
class PromptSpec:
    prompt: str | list[int]   # text, or token ids when prompt_as == "ids"
    prompt_len: int           # tokens, by the benchmark's tokenizer
    output_len: int           # max_tokens asked for (exact when length control works)


@dataclass
class RequestResult:
    ok: bool
    prompt_len: int
    output_len_requested: int
    output_tokens: int = 0
    prompt_tokens_reported: int | None = None   # usage.prompt_tokens from the server
    cached_tokens_reported: int | None = None   # usage.prompt_tokens_details.cached_tokens (prefix-cache hits)
    ttft: float = math.nan                      # seconds
    itl: list[float] = field(default_factory=list)  # seconds between successive text chunks
    e2e: float = math.nan                       # seconds, send -> end of stream
    start: float = 0.0                          # seconds since the benchmark started
    error: str | None = None

    @property
    def tpot(self) -> float:
        """Mean time per output token after the first; NaN when fewer than 2 tokens."""
        if not self.ok or self.output_tokens < 2:
            return math.nan
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


# ----------------------------------------------------------------------------- prompts

def load_tokenizer(path: str) -> Any:
    if not Path(path).is_dir():
        raise ValueError(f"tokenizer must be a local directory with tokenizer files, got {path!r}")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def read_corpus(corpus: str | None = None, max_chars: int = 400_000) -> str:
    """Concatenated real text: every .md/.py file under `corpus` (default: this repository), sorted."""
    root = Path(corpus) if corpus else REPO_ROOT
    if root.is_file():
        files = [root]
    elif root.is_dir():
        files = sorted(
            p for p in root.rglob("*")
            if p.suffix in (".md", ".py") and p.is_file()
            and not any(part.startswith(".") or part == "__pycache__" for part in p.relative_to(root).parts)
        )
    else:
        raise ValueError(f"corpus path does not exist: {root}")
    parts: list[str] = []
    total = 0
    for p in files:
        text = p.read_text(errors="replace")
        parts.append(text)
        total += len(text)
        if total >= max_chars:
            break
    text = "\n".join(parts)[:max_chars]
    if not text.strip():
        raise ValueError(f"corpus {root} holds no .md/.py text")
    return text


def build_prompts(cfg: BenchConfig, tokenizer: Any, n: int | None = None) -> list[PromptSpec]:
    """Deterministic (seeded) prompts cut from the corpus at random offsets, with uniform lengths."""
    n = cfg.num_requests if n is None else n
    rng = np.random.default_rng(cfg.seed)
    pool = list(tokenizer.encode(read_corpus(cfg.corpus, cfg.corpus_max_chars), add_special_tokens=False, verbose=False))
    if not pool:
        raise ValueError("the tokenizer produced no tokens from the corpus")
    # Tile so that any window of prompt_len_max (+ slack for text re-encoding) fits.
    reps = math.ceil((2 * cfg.prompt_len_max + 1) / len(pool)) + 1
    pool = pool * reps
    specs: list[PromptSpec] = []
    for _ in range(n):
        plen = int(rng.integers(cfg.prompt_len_min, cfg.prompt_len_max + 1))
        olen = int(rng.integers(cfg.output_len_min, cfg.output_len_max + 1))
        start = int(rng.integers(0, len(pool) - 2 * plen))
        ids = pool[start:start + plen]
        if cfg.prompt_as == "ids":
            specs.append(PromptSpec(prompt=list(ids), prompt_len=plen, output_len=olen))
        else:
            text, actual = _text_of_length(tokenizer, ids, pool[start + plen:], plen)
            specs.append(PromptSpec(prompt=text, prompt_len=actual, output_len=olen))
    return specs


def _text_of_length(tokenizer: Any, ids: list[int], more: list[int], target: int) -> tuple[str, int]:
    """Decode ids to text whose re-encoding is as close to `target` tokens as a few tries allow."""
    text = tokenizer.decode(ids)
    for _ in range(4):
        again = tokenizer.encode(text, add_special_tokens=False)
        if len(again) == target:
            return text, target
        if len(again) > target:
            ids = again[:target]
        else:
            ids = again + more[: target - len(again)]
        text = tokenizer.decode(ids)
    return text, len(tokenizer.encode(text, add_special_tokens=False))


def arrival_times(n: int, rate: float, seed: int) -> np.ndarray:
    """[n] send offsets in seconds: a Poisson process of `rate` req/s (all zero when rate is inf)."""
    if rate == math.inf:
        return np.zeros(n)
    gaps = np.random.default_rng([seed, 1]).exponential(1.0 / rate, size=n)
    gaps[0] = 0.0
    return np.cumsum(gaps)


# ----------------------------------------------------------------------------- one request

def request_body(cfg: BenchConfig, spec: PromptSpec) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": cfg.model,
        "max_tokens": spec.output_len,
        "temperature": cfg.temperature,
        "stream": True,
    }
    if cfg.include_usage:
        body["stream_options"] = {"include_usage": True}
    if cfg.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": spec.prompt}]
    else:
        body["prompt"] = spec.prompt
    if cfg.length_control == "ignore_eos":
        body["ignore_eos"] = True
    elif cfg.length_control == "hf_generation_config":
        body["generation_config"] = json.dumps(
            {"max_new_tokens": spec.output_len, "min_new_tokens": spec.output_len, "do_sample": cfg.temperature > 0}
        )
    body.update(cfg.extra_body)
    return body


def _chunk_text(chunk: dict[str, Any], endpoint: str) -> str:
    text = ""
    for choice in chunk.get("choices") or []:
        if endpoint == "chat":
            delta = choice.get("delta") or {}
            text += (delta.get("content") or "") + (delta.get("reasoning_content") or "")
        else:
            text += choice.get("text") or ""
    return text


async def send_one(client: Any, cfg: BenchConfig, spec: PromptSpec, t0: float) -> RequestResult:
    """Send one streaming request; parse the SSE `data:` lines until `[DONE]` or end of stream."""
    path = "/v1/chat/completions" if cfg.endpoint == "chat" else "/v1/completions"
    res = RequestResult(ok=False, prompt_len=spec.prompt_len, output_len_requested=spec.output_len)
    n_chunks = 0
    usage_tokens: int | None = None
    last = start = time.perf_counter()
    res.start = start - t0
    try:
        async with client.stream("POST", cfg.base_url.rstrip("/") + path, json=request_body(cfg, spec)) as resp:
            if resp.status_code != 200:
                detail = (await resp.aread()).decode(errors="replace")[:300]
                res.error = f"HTTP {resp.status_code}: {detail}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators, comments, `event:` lines
                payload = line[len("data:"):].strip()
                if payload == "[DONE]":
                    break
                chunk = json.loads(payload)
                if "error" in chunk:
                    res.error = f"stream error: {str(chunk['error'])[:300]}"
                    return res
                now = time.perf_counter()
                # a finish with no text yet: the output was special tokens only (an EOS first), which
                # is a completed request whose first token came with its end
                finished = any(c.get("finish_reason") for c in chunk.get("choices") or [])
                if _chunk_text(chunk, cfg.endpoint) or (finished and n_chunks == 0):
                    if n_chunks == 0:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
                    n_chunks += 1
                usage = chunk.get("usage")
                if usage:
                    usage_tokens = usage.get("completion_tokens", usage_tokens)
                    res.prompt_tokens_reported = usage.get("prompt_tokens", res.prompt_tokens_reported)
                    details = usage.get("prompt_tokens_details") or {}
                    res.cached_tokens_reported = details.get("cached_tokens", res.cached_tokens_reported)
        res.e2e = time.perf_counter() - start
    except Exception as exc:  # one failed request must not end the benchmark
        res.error = f"{type(exc).__name__}: {exc}"[:300]
        return res
    res.output_tokens = usage_tokens if usage_tokens is not None else n_chunks
    if n_chunks == 0:
        res.error = "stream ended without any text or finish_reason"
        return res
    res.ok = True
    return res


# ----------------------------------------------------------------------------- the run

async def _run_async(cfg: BenchConfig, specs: list[PromptSpec]) -> tuple[list[RequestResult], float]:
    import httpx

    offsets = arrival_times(len(specs), cfg.request_rate, cfg.seed)
    sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    results: list[RequestResult | None] = [None] * len(specs)
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(cfg.timeout), limits=limits, headers=headers,
                                 trust_env=False) as client:
        t0 = time.perf_counter()

        async def launch(i: int) -> None:
            delay = offsets[i] - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            if sem is None:
                results[i] = await send_one(client, cfg, specs[i], t0)
            else:
                async with sem:
                    results[i] = await send_one(client, cfg, specs[i], t0)

        tasks = [asyncio.create_task(launch(i)) for i in range(len(specs))]
        done, pending = await asyncio.wait(tasks, timeout=cfg.timeout)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        duration = time.perf_counter() - t0
    final: list[RequestResult] = []
    for spec, r in zip(specs, results):
        if r is None:
            r = RequestResult(ok=False, prompt_len=spec.prompt_len, output_len_requested=spec.output_len,
                              error=f"not finished within the global timeout of {cfg.timeout:g} s")
        final.append(r)
    return final, duration


def compute_metrics(results: Sequence[RequestResult], duration: float, slo_ttft_ms: float,
                    slo_tpot_ms: float) -> dict[str, Any]:
    """Aggregate per-request results of one run of `duration` seconds into the reported numbers.

    A request is "good" when it succeeded, TTFT <= slo_ttft and TPOT <= slo_tpot (TPOT is undefined
    for a 1-token output and then does not count against it). goodput = good requests / duration.
    """
    if duration <= 0:
        raise ValueError(f"duration must be > 0, got {duration}")
    ok = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens_reported if r.prompt_tokens_reported is not None else r.prompt_len for r in ok)
    good = [
        r for r in ok
        if r.ttft * 1000 <= slo_ttft_ms and (math.isnan(r.tpot) or r.tpot * 1000 <= slo_tpot_ms)
    ]
    errors: dict[str, int] = {}
    for r in failed:
        errors[r.error or "unknown"] = errors.get(r.error or "unknown", 0) + 1
    return {
        "num_requests": len(results),
        "completed": len(ok),
        "failed": len(failed),
        "errors": errors,
        "duration_s": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "good_requests": len(good),
        "goodput": len(good) / duration,
        "slo": {"ttft_ms": slo_ttft_ms, "tpot_ms": slo_tpot_ms},
        "ttft_ms": summarize([r.ttft for r in ok], 1000.0),
        "tpot_ms": summarize([r.tpot for r in ok if not math.isnan(r.tpot)], 1000.0),
        "itl_ms": summarize([x for r in ok for x in r.itl], 1000.0),
        "e2e_ms": summarize([r.e2e for r in ok], 1000.0),
    }


def run_benchmark(config: BenchConfig, tokenizer: Any | None = None,
                  prompts: list[PromptSpec] | None = None) -> dict[str, Any]:
    """Run one benchmark; returns metrics (see compute_metrics) plus `config` and per-request `requests`.

    `tokenizer` / `prompts` may be passed to reuse them across runs (the prompts then override
    num_requests). Writes `config.json_out` and `config.plot_dir` when set.
    """
    config.validate()
    if prompts is None:
        tok = tokenizer if tokenizer is not None else load_tokenizer(config.tokenizer or config.model)
        prompts = build_prompts(config, tok)
    results, duration = asyncio.run(_run_async(config, prompts))
    report = compute_metrics(results, duration, config.slo_ttft_ms, config.slo_tpot_ms)
    report["config"] = {k: (v if not (isinstance(v, float) and math.isinf(v)) else "inf")
                        for k, v in dataclasses.asdict(config).items()}
    report["requests"] = [
        {**dataclasses.asdict(r), "tpot": r.tpot} for r in results
    ]
    if config.json_out:
        Path(config.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(config.json_out).write_text(json.dumps(_json_safe(report), indent=2))
    if config.plot_dir:
        write_plots(report, Path(config.plot_dir))
    return report


def _json_safe(obj: Any) -> Any:
    """NaN/inf are not JSON: write them as null."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_json_safe(v) for v in obj]
    return obj


# ----------------------------------------------------------------------------- output

def format_table(report: dict[str, Any]) -> str:
    rows = [
        ("requests completed / failed", f"{report['completed']} / {report['failed']}"),
        ("duration (s)", f"{report['duration_s']:.2f}"),
        ("input / output tokens", f"{report['total_input_tokens']} / {report['total_output_tokens']}"),
        ("request throughput (req/s)", f"{report['request_throughput']:.3f}"),
        ("output throughput (tok/s)", f"{report['output_throughput']:.2f}"),
        ("total token throughput (tok/s)", f"{report['total_token_throughput']:.2f}"),
        (f"goodput (req/s, TTFT<={report['slo']['ttft_ms']:g}ms TPOT<={report['slo']['tpot_ms']:g}ms)",
         f"{report['goodput']:.3f} ({report['good_requests']} good)"),
    ]
    lines = [f"{k:<58} {v}" for k, v in rows]
    lines.append(f"{'latency (ms)':<14}{'mean':>10}{'p50':>10}{'p95':>10}{'p99':>10}{'max':>10}")
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        s = report[name]
        lines.append(f"{name[:-3].upper():<14}" + "".join(f"{s[k]:>10.2f}" for k in ("mean", "p50", "p95", "p99", "max")))
    for err, count in list(report["errors"].items())[:5]:
        lines.append(f"error x{count}: {err}")
    return "\n".join(lines)


def write_plots(report: dict[str, Any], out_dir: Path) -> list[Path]:
    """PNG charts: TTFT / TPOT / ITL histograms and e2e latency over the run's timeline."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise RuntimeError("--plot needs matplotlib: pip install matplotlib (or the [bench] extra)") from exc
    out_dir.mkdir(parents=True, exist_ok=True)
    ok = [r for r in report["requests"] if r["ok"]]
    paths: list[Path] = []
    series = {
        "ttft": [r["ttft"] * 1000 for r in ok],
        "tpot": [r["tpot"] * 1000 for r in ok if r["tpot"] is not None and not math.isnan(r["tpot"])],
        "itl": [x * 1000 for r in ok for x in r["itl"]],
    }
    for name, values in series.items():
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.hist(values, bins=min(50, max(5, len(values) // 4)))
        ax.set_xlabel(f"{name.upper()} (ms)")
        ax.set_ylabel("count")
        ax.set_title(f"{name.upper()} distribution ({len(values)} samples)")
        fig.tight_layout()
        paths.append(out_dir / f"{name}_hist.png")
        fig.savefig(paths[-1])
        plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.scatter([r["start"] for r in ok], [r["e2e"] * 1000 for r in ok], s=8, label="e2e")
    ax.scatter([r["start"] for r in ok], [r["ttft"] * 1000 for r in ok], s=8, label="ttft")
    ax.set_xlabel("request start (s since benchmark start)")
    ax.set_ylabel("latency (ms)")
    ax.legend()
    fig.tight_layout()
    paths.append(out_dir / "latency_timeline.png")
    fig.savefig(paths[-1])
    plt.close(fig)
    return paths


def _rate(text: str) -> float:
    return math.inf if text.lower() in ("inf", "infinity") else float(text)


def parse_args(argv: list[str] | None = None, prog: str | None = None) -> BenchConfig:
    from jaxserve.entrypoints.cli import HelpFormatter  # every flag's default in --help, as in `jaxserve serve --help`

    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    p.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    p.add_argument("--model", required=True, help="model name sent in the request body")
    p.add_argument("--tokenizer", default=None, help="local tokenizer dir (default: the embedded model's for "
                   "jaxserve-tiny, else --model when it is a local dir or a hub id in the local HF cache)")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions", help="API route")
    p.add_argument("--num-requests", type=int, default=64, help="requests to send")
    p.add_argument("--request-rate", type=_rate, default=math.inf, help="req/s (Poisson), 'inf' = burst")
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight (default: no limit)")
    p.add_argument("--prompt-len-min", type=int, default=64, help="shortest prompt, tokens")
    p.add_argument("--prompt-len-max", type=int, default=256, help="longest prompt, tokens")
    p.add_argument("--output-len-min", type=int, default=64, help="shortest output asked for, tokens")
    p.add_argument("--output-len-max", type=int, default=64, help="longest output asked for, tokens")
    p.add_argument("--prompt-as", choices=["text", "ids"], default="ids", help="send prompts as text or token ids")
    p.add_argument("--seed", type=int, default=0, help="seeds prompts, lengths and arrivals")
    p.add_argument("--timeout", type=float, default=600.0, help="global bound on the run, seconds")
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0, help="TTFT bound of a good request")
    p.add_argument("--slo-tpot-ms", type=float, default=200.0, help="TPOT bound of a good request")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature sent")
    p.add_argument("--no-usage", action="store_true", help="do not ask for stream_options.include_usage")
    p.add_argument("--length-control", choices=["ignore_eos", "hf_generation_config", "none"], default="ignore_eos",
                   help="how the output length is forced")
    p.add_argument("--extra-body", type=json.loads, default={}, help="JSON merged into every request body")
    p.add_argument("--corpus", help="file or dir of .md/.py text for prompts (default: this repository)")
    p.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--json-out", help="write the report as JSON here")
    p.add_argument("--plot", dest="plot_dir", help="write PNG charts into this dir (needs matplotlib)")
    a = p.parse_args(argv)
    # Checked before the run, not after it: a missing plotting library must not cost the benchmark.
    if a.plot_dir and importlib.util.find_spec("matplotlib") is None:
        p.error("--plot needs matplotlib: pip install matplotlib (or jaxserve's [bench] extra)")
    cfg = BenchConfig(
        base_url=a.base_url, model=a.model, tokenizer=a.tokenizer, endpoint=a.endpoint,
        num_requests=a.num_requests, request_rate=a.request_rate, max_concurrency=a.max_concurrency,
        prompt_len_min=a.prompt_len_min, prompt_len_max=a.prompt_len_max,
        output_len_min=a.output_len_min, output_len_max=a.output_len_max, prompt_as=a.prompt_as,
        seed=a.seed, timeout=a.timeout, slo_ttft_ms=a.slo_ttft_ms, slo_tpot_ms=a.slo_tpot_ms,
        temperature=a.temperature, include_usage=not a.no_usage, length_control=a.length_control,
        extra_body=a.extra_body, corpus=a.corpus, api_key=a.api_key, json_out=a.json_out, plot_dir=a.plot_dir,
    )
    try:  # a bad flag is a usage error, not a traceback
        cfg.validate()
        cfg.tokenizer = cfg.tokenizer or default_tokenizer(cfg.model)
    except ValueError as e:
        p.error(str(e))
    return cfg


def default_tokenizer(model: str) -> str:
    """The tokenizer directory for --model when --tokenizer is not given: the embedded default
    model's for jaxserve-tiny, a local directory as it is, a hub id from the local HF cache.
    Raises ValueError naming --tokenizer otherwise."""
    path = Path(model).expanduser()
    if path.is_dir():
        return str(path)
    from jaxserve.default_model import MODEL_NAME, ensure_default_model

    if model == MODEL_NAME:
        return str(ensure_default_model())
    from checkpoints import resolve_model_dir

    try:
        return str(resolve_model_dir(model))
    except (FileNotFoundError, ValueError) as e:
        raise ValueError(f"no tokenizer for --model {model!r}: pass --tokenizer DIR, a local directory with the "
                         f"model's tokenizer files ({e})") from None


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """The command line (`prog`: the name usage lines show, e.g. "jaxserve bench")."""
    cfg = parse_args(argv, prog)
    report = run_benchmark(cfg)
    print(format_table(report))
    return 0 if report["completed"] > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
