"""Prefix-cache TTFT: the same ~1,000-token system prompt with and without a prefix-cache hit.

    python scripts/bench_prefix_cache.py --model-preset bench-small --num-questions 16 --docs
    python scripts/bench_prefix_cache.py --smoke            # tiny model, 4 questions, no docs

Starts `jaxserve serve`, builds a system prompt of --system-tokens tokens of repository text and
--num-questions distinct short questions, and sends one request at a time (so TTFT is the prefill
of that request alone) to /v1/completions with a small max_tokens. Each question is asked twice:
"uncached" with a fresh random `cache_salt` (a new salt is a new prefix-cache namespace, so nothing
hits) and "cached" with one fixed salt, which a warm-up request (not counted) has filled with the
system prompt. The two kinds alternate, and which goes first alternates too. Reports TTFT median /
p90 of each kind and the ratio uncached / cached, as a table and JSON; --docs writes the table
between the bench_prefix_cache markers of docs/BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import math
import shlex
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_serving as bs  # noqa: E402
from bench_common import (  # noqa: E402
    REPO_ROOT, free_port, http_ok, machine_info, percentile, replace_marked_section, server_process,
)
from bench_vs_peers import (  # noqa: E402
    DOCS_HEADER, PRESETS, bench_env, describe_model, ensure_preset, jaxserve_command, served_model_name,
)

MARK_START = "<!-- bench_prefix_cache:start -->"
MARK_END = "<!-- bench_prefix_cache:end -->"
DEFAULT_JAXSERVE_ARGS = "--token-buckets 16,32,64,128,256,512,1024 --seq-buckets 4 --max-model-len 2048"
SMOKE_JAXSERVE_ARGS = "--token-buckets 32,256 --seq-buckets 4 --max-model-len 512"

# Topics for the questions: short, distinct, about this repository.
TOPICS = ("the scheduler", "the page allocator", "prefix caching", "the sampler", "token buckets",
          "sequence buckets", "the detokenizer", "the OpenAI server", "tensor parallelism", "the KV cache",
          "chunked prefill", "preemption", "the roofline script", "the load generator", "stop strings",
          "the engine core")


def questions(n: int) -> list[str]:
    """n distinct short user questions (the number makes each one distinct beyond the topic list)."""
    if n < 1:
        raise ValueError(f"need at least one question, got {n}")
    return [f"Question {i + 1}: in one sentence, what does {TOPICS[i % len(TOPICS)]} do here?" for i in range(n)]


def system_prompt(tokenizer: Any, n_tokens: int, corpus: str | None = None) -> tuple[str, int]:
    """About n_tokens tokens of repository text (its README and docs first); returns (text, tokens)."""
    if n_tokens < 1:
        raise ValueError(f"system prompt needs >= 1 token, got {n_tokens}")
    ids = tokenizer.encode(bs.read_corpus(corpus, max_chars=max(20_000, 8 * n_tokens)), add_special_tokens=False,
                           verbose=False)
    if len(ids) < n_tokens:
        raise ValueError(f"the corpus holds only {len(ids)} tokens, fewer than the {n_tokens} asked for")
    return bs._text_of_length(tokenizer, ids[:n_tokens], ids[n_tokens:], n_tokens)


def full_prompt(system: str, question: str) -> str:
    return f"{system}\n\nUser: {question}\nAssistant:"


@dataclass
class Sample:
    kind: str             # "uncached" or "cached"
    question: int         # index into the questions
    ttft_s: float
    cached_tokens: int | None
    prompt_tokens: int | None
    ok: bool
    error: str | None = None


def schedule(n_questions: int) -> list[tuple[int, str]]:
    """(question, kind) in send order: each question uncached and cached, the first of the pair
    alternating so that neither kind always follows the other."""
    order = []
    for i in range(n_questions):
        pair = ["uncached", "cached"] if i % 2 == 0 else ["cached", "uncached"]
        order += [(i, kind) for kind in pair]
    return order


def summarize_ttft(uncached_s: Sequence[float], cached_s: Sequence[float]) -> dict[str, Any]:
    """Median and p90 TTFT (ms) of each kind and the ratios uncached / cached of both."""
    def stats(xs: Sequence[float]) -> dict[str, float]:
        ms = [x * 1000 for x in xs]
        return {"n": len(ms), "median_ms": percentile(ms, 50), "p90_ms": percentile(ms, 90)}

    u, c = stats(uncached_s), stats(cached_s)

    def ratio(key: str) -> float:
        return u[key] / c[key] if c[key] > 0 else math.nan

    return {"uncached": u, "cached": c, "ratio_median": ratio("median_ms"), "ratio_p90": ratio("p90_ms")}


async def _ask(client: Any, cfg: bs.BenchConfig, spec: bs.PromptSpec, salt: str) -> bs.RequestResult:
    return await bs.send_one(client, replace(cfg, extra_body={**cfg.extra_body, "cache_salt": salt}), spec,
                             time.perf_counter())


async def run_samples(cfg: bs.BenchConfig, system: str, qs: list[str], warm_question: str,
                      tokenizer: Any) -> list[Sample]:
    """Warm up (one fresh-salt request, one fixed-salt request that caches the system prompt), then
    every question uncached and cached, one request at a time."""
    import httpx

    fixed = "bench-prefix-cache-" + uuid.uuid4().hex

    def spec(q: str) -> bs.PromptSpec:
        text = full_prompt(system, q)
        return bs.PromptSpec(prompt=text, prompt_len=len(tokenizer.encode(text, add_special_tokens=False)),
                             output_len=cfg.output_len_max)

    samples: list[Sample] = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(cfg.timeout), trust_env=False) as client:
        for salt in (uuid.uuid4().hex, fixed):
            warm = await _ask(client, cfg, spec(warm_question), salt)
            if not warm.ok:
                raise RuntimeError(f"warm-up request failed: {warm.error}")
        for i, kind in schedule(len(qs)):
            r = await _ask(client, cfg, spec(qs[i]), fixed if kind == "cached" else uuid.uuid4().hex)
            samples.append(Sample(kind, i, r.ttft, r.cached_tokens_reported, r.prompt_tokens_reported, r.ok, r.error))
    return samples


def report(samples: list[Sample]) -> dict[str, Any]:
    ok = [s for s in samples if s.ok]
    summary = summarize_ttft([s.ttft_s for s in ok if s.kind == "uncached"], [s.ttft_s for s in ok if s.kind == "cached"])
    for kind in ("uncached", "cached"):
        hits = [s.cached_tokens for s in ok if s.kind == kind and s.cached_tokens is not None]
        summary[kind]["cached_tokens_median"] = percentile(hits, 50) if hits else math.nan
        summary[kind]["failed"] = sum(1 for s in samples if s.kind == kind and not s.ok)
    summary["prompt_tokens_median"] = percentile([s.prompt_tokens for s in ok if s.prompt_tokens is not None], 50)
    summary["errors"] = sorted({s.error for s in samples if s.error})
    return summary


def _fmt(x: float, digits: int = 1) -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def markdown_report(summary: dict[str, Any], meta: dict[str, Any]) -> str:
    lines = [
        f"### bench_prefix_cache — {meta['date']}",
        "",
        f"- model: `{meta['model']}` — {meta['model_desc']}",
        f"- workload: {meta['workload']}",
        "",
        "| requests | n | TTFT median ms | TTFT p90 ms | cached prompt tokens (median) | failed |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for kind, label in (("uncached", "uncached (fresh cache_salt)"), ("cached", "cached (shared cache_salt)")):
        k = summary[kind]
        lines.append(f"| {label} | {k['n']} | {_fmt(k['median_ms'])} | {_fmt(k['p90_ms'])} "
                     f"| {_fmt(k['cached_tokens_median'], 0)} | {k['failed']} |")
    lines += ["", f"**TTFT uncached / cached: {_fmt(summary['ratio_median'], 2)}x at the median, "
                  f"{_fmt(summary['ratio_p90'], 2)}x at p90**"]
    lines += [f"- error: {e}" for e in summary["errors"][:5]]
    lines += ["", "Machine: " + ", ".join(f"{k} {v}" for k, v in meta["machine"].items()), "",
              f"Command: `{meta['command']}`"]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", help="local HF model dir (config.json, safetensors, tokenizer files)")
    src.add_argument("--model-preset", choices=sorted(PRESETS), help="default bench-small (tiny in --smoke)")
    p.add_argument("--cache-dir", type=Path, help="where presets are written (default ~/.cache/jaxserve/bench-models)")
    p.add_argument("--tokenizer-source", type=Path, help="dir whose tokenizer files presets copy")
    p.add_argument("--num-questions", type=int, default=16)
    p.add_argument("--system-tokens", type=int, default=1000, help="length of the shared system prompt")
    p.add_argument("--max-tokens", type=int, default=8, help="output tokens per request (EOS ignored)")
    p.add_argument("--max-num-seqs", type=int, default=4)
    p.add_argument("--max-num-batched-tokens", type=int, default=1024,
                   help="step budget: an uncached ~1,030-token prompt prefills as 1024 + a few tokens "
                        "(fine token buckets keep padding small, so neither kind is charged for padding)")
    p.add_argument("--jaxserve-args", default=None, help=f"extra `jaxserve serve` flags (default {DEFAULT_JAXSERVE_ARGS!r})")
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--timeout", type=float, default=300.0, help="bound on each request, seconds")
    p.add_argument("--docs", nargs="?", type=Path, const=REPO_ROOT / "docs" / "BENCHMARKS.md",
                   help="write the section into this markdown file (default path docs/BENCHMARKS.md)")
    p.add_argument("--json-out", type=Path)
    p.add_argument("--log-dir", type=Path, default=Path(tempfile.gettempdir()) / "bench_prefix_cache_logs")
    p.add_argument("--smoke", action="store_true", help="tiny model, 4 questions, a 200-token system prompt")
    a = p.parse_args(argv)
    if a.smoke:
        if not a.model and not a.model_preset:
            a.model_preset = "tiny"
        a.num_questions, a.system_tokens, a.max_tokens = 4, 200, 4
        a.max_num_batched_tokens = 256
        a.jaxserve_args = a.jaxserve_args or SMOKE_JAXSERVE_ARGS
        a.start_timeout, a.timeout = min(a.start_timeout, 120.0), min(a.timeout, 30.0)
    elif not a.model and not a.model_preset:
        a.model_preset = "bench-small"
    a.jaxserve_args = a.jaxserve_args or DEFAULT_JAXSERVE_ARGS
    if a.num_questions < 1 or a.system_tokens < 1 or a.max_tokens < 1:
        raise ValueError("--num-questions, --system-tokens and --max-tokens must be >= 1")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    t_start = time.monotonic()
    model_dir = Path(a.model) if a.model else ensure_preset(a.model_preset, a.cache_dir, a.tokenizer_source)
    tokenizer = bs.load_tokenizer(str(model_dir))
    system, n_system = system_prompt(tokenizer, a.system_tokens)
    qs = questions(a.num_questions)
    port = free_port()
    cfg = bs.BenchConfig(base_url=f"http://127.0.0.1:{port}", model=str(model_dir), prompt_as="text",
                         output_len_min=a.max_tokens, output_len_max=a.max_tokens, timeout=a.timeout,
                         length_control="ignore_eos")
    cmd = jaxserve_command(model_dir, port, a.max_num_seqs, a.max_num_batched_tokens,
                           a.jaxserve_args + " --enable-prefix-caching")
    health = f"http://127.0.0.1:{port}/health"
    if http_ok(health, timeout=1):
        raise RuntimeError(f"port {port} already serves something; not benchmarking a stranger")
    with contextlib.ExitStack() as stack:
        stack.enter_context(server_process(cmd, health, a.log_dir / "jaxserve.log", a.start_timeout, bench_env()))
        cfg = replace(cfg, model=served_model_name(cfg.base_url, cfg.model))
        samples = asyncio.run(run_samples(cfg, system, qs, "Warm-up: what is this text about?", tokenizer))

    summary = report(samples)
    meta = {
        "date": dt.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "model": a.model_preset or str(model_dir),
        "model_desc": describe_model(model_dir),
        "workload": (f"a {n_system}-token system prompt of repository text + {len(qs)} distinct short questions "
                     f"(prompts ~{_fmt(summary['prompt_tokens_median'], 0)} tokens), {a.max_tokens} output tokens, "
                     f"one request at a time, each question once uncached and once cached (alternating); "
                     f"jaxserve flags: `{shlex.join(cmd[cmd.index('--max-num-seqs'):])}`"),
        "machine": machine_info(),
        "command": " ".join(shlex.quote(x) for x in ["python", "scripts/bench_prefix_cache.py",
                                                      *(argv if argv is not None else sys.argv[1:])]),
    }
    md = markdown_report(summary, meta)
    print(md)
    if a.docs is not None:
        replace_marked_section(a.docs, MARK_START, MARK_END, md, DOCS_HEADER)
        print(f"wrote {a.docs}")
    if a.json_out:
        a.json_out.parent.mkdir(parents=True, exist_ok=True)
        a.json_out.write_text(json.dumps(bs._json_safe({"meta": meta, "summary": summary,
                                                        "samples": [vars(s) for s in samples]}), indent=2))
    print(f"total wall time {time.monotonic() - t_start:.1f} s")
    both = summary["uncached"]["n"] and summary["cached"]["n"]
    return 0 if both else 1


if __name__ == "__main__":
    sys.exit(main())
