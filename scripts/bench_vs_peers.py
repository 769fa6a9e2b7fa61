"""jaxserve against its peers on one model and one workload, interleaved and repeated (medians).

    python scripts/bench_vs_peers.py --model-preset bench-small --repeats 3
    python scripts/bench_vs_peers.py --smoke          # tiny model, 4 requests, 1 repeat, < 60 s

Systems (choose with --systems):
  jaxserve  `python -m jaxserve.cli serve` (continuous batching), driven by bench_serving
  hf-static Hugging Face transformers `generate`, static batches (left-padded, greedy, fixed length)
  hf-serve  `transformers serve --continuous-batching`, driven by the same load generator
Every system gets the same text prompts and the same output length. The markdown table goes into
docs/BENCHMARKS.md between the bench_vs_peers markers (other sections are left untouched).
"""
from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import importlib.util
import json
import math
import os
import shlex
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_serving as bs  # noqa: E402
from bench_common import (  # noqa: E402
    REPO_ROOT, free_port, http_ok, machine_info, median, replace_marked_section, server_process,
)

if str(REPO_ROOT) not in sys.path:  # run from a checkout without `pip install -e .`
    sys.path.append(str(REPO_ROOT))

MARK_START = "<!-- bench_vs_peers:start -->"
MARK_END = "<!-- bench_vs_peers:end -->"
DOCS_HEADER = "# Benchmarks\n\nNumbers measured by the scripts in `scripts/`; each section names its command.\n"

QWEN_VOCAB = 151936
# Qwen3 architecture, random weights; sizes from the benchmark plan.
PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16, intermediate_size=192),
    "bench-small": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                        head_dim=32, intermediate_size=768),
    "bench-105m": dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                       head_dim=64, intermediate_size=1536),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
                   "special_tokens_map.json", "added_tokens.json", "chat_template.jinja", "chat_template.json")


# ----------------------------------------------------------------------------- model presets

def default_bench_cache() -> Path:
    env = os.environ.get("JAXSERVE_CACHE")
    return (Path(env).expanduser() if env else Path.home() / ".cache" / "jaxserve") / "bench-models"


def ensure_preset(name: str, cache_dir: Path | None = None, tokenizer_source: Path | None = None) -> Path:
    """Write the preset model dir once (transformers Qwen3, float32, seeded random weights) and return it."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose from {sorted(PRESETS)}")
    dest = (cache_dir or default_bench_cache()) / name
    if (dest / ".complete").exists():
        return dest
    if tokenizer_source is None:
        try:
            from jaxserve.default_model import ensure_default_model
        except ImportError as exc:
            raise RuntimeError("jaxserve.default_model is unavailable; pass --tokenizer-source DIR") from exc
        tokenizer_source = Path(ensure_default_model())
    copied = [f for f in TOKENIZER_FILES if (Path(tokenizer_source) / f).is_file()]
    if "tokenizer.json" not in copied and "vocab.json" not in copied:
        raise ValueError(f"{tokenizer_source} holds no tokenizer.json / vocab.json to copy")

    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=QWEN_VOCAB, tie_word_embeddings=True, max_position_embeddings=4096, rms_norm_eps=1e-6,
        bos_token_id=151643, eos_token_id=151645, pad_token_id=151643, **PRESETS[name],
    )
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).to(torch.float32).eval()
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=dest.parent))
    model.save_pretrained(tmp)
    for f in copied:
        shutil.copy2(Path(tokenizer_source) / f, tmp / f)
    (tmp / ".complete").write_text("ok\n")
    if dest.exists():  # an incomplete earlier attempt
        shutil.rmtree(dest)
    os.replace(tmp, dest)
    return dest


def describe_model(model_dir: Path) -> str:
    cfg = json.loads((model_dir / "config.json").read_text())
    from roofline import model_shape

    s = model_shape(cfg)
    return (f"{cfg.get('model_type')} {s['total_params'] / 1e6:.1f} M params (hidden {s['hidden']}, "
            f"{s['layers']} layers, {s['q_heads']}/{s['kv_heads']} heads x {s['head_dim']}, vocab {s['vocab']}, "
            f"{cfg.get('dtype') or cfg.get('torch_dtype')})")


# ----------------------------------------------------------------------------- systems

@dataclass
class Outcome:
    """One measurement of one system: the numbers the table shows (NaN where not applicable)."""
    output_throughput: float
    total_token_throughput: float
    request_throughput: float
    ttft_p50_ms: float = math.nan
    tpot_p50_ms: float = math.nan
    e2e_p50_ms: float = math.nan
    out_tokens_per_req: float = math.nan
    failed: int = 0


@dataclass
class System:
    name: str
    measure: Callable[[], Outcome]
    is_jaxserve: bool = False
    outcomes: list[Outcome] = field(default_factory=list)
    error: str | None = None


def outcome_from_report(report: dict[str, Any]) -> Outcome:
    done = max(report["completed"], 1)
    return Outcome(
        output_throughput=report["output_throughput"], total_token_throughput=report["total_token_throughput"],
        request_throughput=report["request_throughput"], ttft_p50_ms=report["ttft_ms"]["p50"],
        tpot_p50_ms=report["tpot_ms"]["p50"], e2e_p50_ms=report["e2e_ms"]["p50"],
        out_tokens_per_req=report["total_output_tokens"] / done, failed=report["failed"],
    )


def served_model_name(base_url: str, fallback: str) -> str:
    """The first id of GET /v1/models (servers name a local dir differently); `fallback` if none."""
    import httpx

    try:
        data = httpx.get(base_url + "/v1/models", timeout=10, trust_env=False).json().get("data") or []
        return data[0]["id"] if data else fallback
    except Exception:  # a server without /v1/models is still benchmarkable
        return fallback


class ServerSystem:
    """Starts its server on first use (kept for all repeats), warms it, then runs the load generator."""

    def __init__(self, stack: contextlib.ExitStack, cmd: list[str], port: int, health_path: str,
                 cfg: bs.BenchConfig, prompts: list[bs.PromptSpec], log_path: Path, start_timeout: float,
                 env: dict[str, str]):
        self.stack, self.cmd, self.port, self.cfg, self.prompts = stack, cmd, port, cfg, prompts
        self.health_url = f"http://127.0.0.1:{port}{health_path}"
        self.log_path, self.start_timeout, self.env = log_path, start_timeout, env
        self.started = False

    def __call__(self) -> Outcome:
        if not self.started:
            if http_ok(self.health_url, timeout=1):
                raise RuntimeError(f"port {self.port} already serves something; not benchmarking a stranger")
            self.stack.enter_context(server_process(self.cmd, self.health_url, self.log_path,
                                                    self.start_timeout, self.env))
            self.started = True
            self.cfg = replace(self.cfg, model=served_model_name(self.cfg.base_url, self.cfg.model))
            # Warm-up (not recorded): compilation, lazy model load, CB worker start.
            bs.run_benchmark(replace(self.cfg, json_out=None, plot_dir=None), prompts=self.prompts[:4])
        report = bs.run_benchmark(replace(self.cfg, json_out=None, plot_dir=None), prompts=self.prompts)
        if report["completed"] == 0:
            raise RuntimeError(f"every request failed: {report['errors']}")
        return outcome_from_report(report)


class StaticGenerate:
    """transformers `generate` over fixed batches: left padding, greedy, exactly output_len new tokens."""

    def __init__(self, model_dir: Path, prompts: list[bs.PromptSpec], batch_size: int, output_len: int):
        self.model_dir, self.batch_size, self.output_len = model_dir, batch_size, output_len
        self.prompts = prompts
        self.warm = False

    _cache: dict[str, Any] = {}

    def _load(self) -> tuple[Any, Any]:
        key = str(self.model_dir)
        if key not in StaticGenerate._cache:
            import torch
            from transformers import AutoModelForCausalLM, AutoTokenizer

            tok = AutoTokenizer.from_pretrained(self.model_dir, local_files_only=True)
            tok.padding_side = "left"
            if tok.pad_token_id is None:
                tok.pad_token = tok.eos_token
            model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32, local_files_only=True)
            StaticGenerate._cache[key] = (tok, model.eval())
        return StaticGenerate._cache[key]

    def _batches(self) -> list[list[str]]:
        b = self.batch_size
        n = math.ceil(max(len(self.prompts), b) / b) * b  # whole batches, at least one
        texts = [self.prompts[i % len(self.prompts)].prompt for i in range(n)]
        return [texts[i:i + b] for i in range(0, n, b)]

    def _generate(self, texts: list[str], new_tokens: int) -> tuple[int, int]:
        import torch

        tok, model = self._load()
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.inference_mode():
            out = model.generate(**enc, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                 pad_token_id=tok.pad_token_id)
        produced = out.shape[1] - enc["input_ids"].shape[1]
        if produced != new_tokens:
            raise RuntimeError(f"generate produced {produced} tokens, expected {new_tokens}")
        return int(enc["attention_mask"].sum()), len(texts) * produced

    def __call__(self) -> Outcome:
        batches = self._batches()
        if not self.warm:
            self._generate(batches[0], 2)
            self.warm = True
        t = time.perf_counter()
        n_in = n_out = 0
        for texts in batches:
            i, o = self._generate(texts, self.output_len)
            n_in, n_out = n_in + i, n_out + o
        elapsed = time.perf_counter() - t
        n_req = sum(len(x) for x in batches)
        return Outcome(output_throughput=n_out / elapsed, total_token_throughput=(n_in + n_out) / elapsed,
                       request_throughput=n_req / elapsed, e2e_p50_ms=math.nan,
                       out_tokens_per_req=n_out / n_req)


# ----------------------------------------------------------------------------- report

def _fmt(x: float, digits: int = 1) -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def summarize_systems(systems: list[System]) -> list[dict[str, Any]]:
    rows = []
    for s in systems:
        row: dict[str, Any] = {"system": s.name, "is_jaxserve": s.is_jaxserve, "repeats": len(s.outcomes),
                               "error": s.error}
        for key in Outcome.__dataclass_fields__:
            row[key] = median([getattr(o, key) for o in s.outcomes]) if s.outcomes else math.nan
        rows.append(row)
    return rows


def markdown_report(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    jax_rows = [r for r in rows if r["is_jaxserve"] and r["repeats"]]
    jax_tput = jax_rows[0]["output_throughput"] if jax_rows else math.nan
    peers = [r for r in rows if not r["is_jaxserve"] and r["repeats"]]
    best = max(peers, key=lambda r: r["output_throughput"]) if peers else None
    lines = [
        f"### bench_vs_peers — {meta['date']}",
        "",
        f"- model: `{meta['model']}` — {meta['model_desc']}",
        f"- workload: {meta['workload']}",
        f"- repeats: {meta['repeats']}, interleaved; each number is the median over repeats",
        "",
        "| system | output tok/s | total tok/s | req/s | TTFT p50 ms | TPOT p50 ms | E2E p50 ms "
        "| out tok/req | failed | jaxserve ÷ system (output tok/s) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if not r["repeats"]:
            continue
        ratio = "—" if r["is_jaxserve"] else _fmt(jax_tput / r["output_throughput"], 2)
        lines.append(
            f"| {r['system']} | {_fmt(r['output_throughput'])} | {_fmt(r['total_token_throughput'])} "
            f"| {_fmt(r['request_throughput'], 2)} | {_fmt(r['ttft_p50_ms'])} | {_fmt(r['tpot_p50_ms'])} "
            f"| {_fmt(r['e2e_p50_ms'])} | {_fmt(r['out_tokens_per_req'])} | {_fmt(r['failed'], 0)} | {ratio} |"
        )
    lines.append("")
    if best is not None and jax_rows:
        lines.append(f"**jaxserve / best peer ({best['system']}), output tok/s: "
                     f"{_fmt(jax_tput / best['output_throughput'], 2)}**")
    elif best is not None:
        lines.append(f"jaxserve was not measured; best peer: {best['system']} at "
                     f"{_fmt(best['output_throughput'])} output tok/s")
    for r in rows:
        if r["error"]:
            lines.append(f"- not measured: {r['system']} — {r['error']}")
    lines += ["", "Machine: " + ", ".join(f"{k} {v}" for k, v in meta["machine"].items()), "",
              f"Command: `{meta['command']}`"]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- main

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", help="local HF model dir (config.json, safetensors, tokenizer files)")
    src.add_argument("--model-preset", choices=sorted(PRESETS))
    p.add_argument("--cache-dir", type=Path, help="where presets are written (default ~/.cache/jaxserve/bench-models)")
    p.add_argument("--tokenizer-source", type=Path, help="dir whose tokenizer files presets copy (default: the embedded default model)")
    p.add_argument("--systems", default="jaxserve,hf-static,hf-serve")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--prompt-len-min", type=int, default=32)
    p.add_argument("--prompt-len-max", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--request-rate", type=bs._rate, default=math.inf)
    p.add_argument("--max-concurrency", type=int)
    p.add_argument("--batch-sizes", default="1,16,64", help="static-batching sizes for hf-static")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--jaxserve-args", default="--token-buckets 32,64,128,256,512 --seq-buckets 8,16,32,64 --max-model-len 1024",
                   help="extra `jaxserve serve` flags (buckets, context), one string")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--torch-threads", type=int, help="torch intra-op threads for hf-static and hf-serve (default: torch's)")
    p.add_argument("--start-timeout", type=float, default=600.0, help="seconds a server may take to become healthy")
    p.add_argument("--timeout", type=float, default=1800.0, help="bound on each load-generator run, seconds")
    p.add_argument("--docs", type=Path, help="markdown file to update (default docs/BENCHMARKS.md; none in --smoke)")
    p.add_argument("--no-docs", action="store_true")
    p.add_argument("--json-out", type=Path)
    p.add_argument("--log-dir", type=Path, default=Path(tempfile.gettempdir()) / "bench_vs_peers_logs")
    p.add_argument("--smoke", action="store_true", help="tiny model, 4 requests, 1 repeat, hf-static bs=1 only")
    a = p.parse_args(argv)
    if a.smoke:
        if not a.model and not a.model_preset:
            a.model_preset = "tiny"
        a.repeats, a.num_requests, a.batch_sizes = 1, 4, "1"
        a.prompt_len_min, a.prompt_len_max, a.output_len = 16, 32, 8
        a.systems = ",".join(s for s in a.systems.split(",") if s != "hf-serve")
        a.start_timeout, a.timeout = min(a.start_timeout, 30.0), min(a.timeout, 20.0)
    elif not a.model and not a.model_preset:
        a.model_preset = "bench-small"
    if a.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {a.repeats}")
    unknown = set(a.systems.split(",")) - {"jaxserve", "hf-static", "hf-serve"}
    if unknown:
        raise ValueError(f"unknown systems {sorted(unknown)}; choose from jaxserve, hf-static, hf-serve")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    t_start = time.monotonic()
    model_dir = Path(a.model) if a.model else ensure_preset(a.model_preset, a.cache_dir, a.tokenizer_source)
    if not (model_dir / "config.json").is_file():
        raise ValueError(f"{model_dir} is not a model dir (no config.json)")
    wanted = a.systems.split(",")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join(x for x in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if x))
    base = bs.BenchConfig(
        base_url="", model=str(model_dir), tokenizer=str(model_dir), endpoint="completions",
        num_requests=a.num_requests, request_rate=a.request_rate, max_concurrency=a.max_concurrency,
        prompt_len_min=a.prompt_len_min, prompt_len_max=a.prompt_len_max,
        output_len_min=a.output_len, output_len_max=a.output_len, prompt_as="text", seed=a.seed, timeout=a.timeout,
    )
    # One prompt set for every system: text, so that `transformers serve` (text only) gets the same input.
    prompts = bs.build_prompts(base, bs.load_tokenizer(str(model_dir)))
    if a.torch_threads:
        import torch

        torch.set_num_threads(a.torch_threads)

    systems: list[System] = []
    with contextlib.ExitStack() as stack:
        if "jaxserve" in wanted:
            port = free_port()
            cmd = [sys.executable, "-m", "jaxserve.cli", "serve", "--model", str(model_dir), "--host", "127.0.0.1",
                   "--port", str(port), "--max-num-seqs", str(a.max_num_seqs),
                   "--max-num-batched-tokens", str(a.max_num_batched_tokens), "--dtype", "float32",
                   *shlex.split(a.jaxserve_args)]
            cfg = replace(base, base_url=f"http://127.0.0.1:{port}", length_control="ignore_eos")
            s = System("jaxserve (continuous batching)", ServerSystem(
                stack, cmd, port, "/health", cfg, prompts, a.log_dir / "jaxserve.log", a.start_timeout, env),
                is_jaxserve=True)
            if importlib.util.find_spec("jaxserve.cli") is None:
                s.error = "jaxserve.cli is not importable yet"
            systems.append(s)
        if "hf-serve" in wanted:
            port = free_port()
            exe = shutil.which("transformers") or "transformers"
            cmd = [exe, "serve", str(model_dir), "--continuous-batching", "--device", "cpu", "--dtype", "float32",
                   "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
            # `transformers serve` rejects unknown fields (ignore_eos): its own generation_config forces the length.
            cfg = replace(base, base_url=f"http://127.0.0.1:{port}", length_control="hf_generation_config")
            hf_env = dict(env, OMP_NUM_THREADS=str(a.torch_threads)) if a.torch_threads else env
            s = System("transformers serve --continuous-batching", ServerSystem(
                stack, cmd, port, "/health", cfg, prompts, a.log_dir / "transformers_serve.log", a.start_timeout, hf_env))
            if importlib.util.find_spec("fastapi") is None:
                s.error = "`transformers serve` needs fastapi, which is not installed"
            systems.append(s)
        if "hf-static" in wanted:
            for b in (int(x) for x in a.batch_sizes.split(",")):
                systems.append(System(f"transformers generate, static batch {b}",
                                      StaticGenerate(model_dir, prompts, b, a.output_len)))

        for rep in range(a.repeats):
            for s in systems:
                if s.error:
                    continue
                try:
                    s.outcomes.append(s.measure())
                    o = s.outcomes[-1]
                    print(f"[repeat {rep + 1}/{a.repeats}] {s.name}: {o.output_throughput:.1f} output tok/s, "
                          f"{o.request_throughput:.2f} req/s", flush=True)
                except Exception as exc:  # a system that cannot run is reported, not fatal
                    s.error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
                    print(f"[repeat {rep + 1}/{a.repeats}] {s.name}: FAILED {s.error}", flush=True)

    arrivals = ("burst (all at t=0)" if a.request_rate == math.inf else f"Poisson {a.request_rate:g} req/s")
    if a.max_concurrency:
        arrivals += f", at most {a.max_concurrency} in flight"
    meta = {
        "date": dt.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "model": a.model_preset or str(model_dir),
        "model_desc": describe_model(model_dir),
        "workload": (f"{len(prompts)} requests, prompts {a.prompt_len_min}–{a.prompt_len_max} tokens of repository "
                     f"text (seed {a.seed}), {a.output_len} output tokens each (EOS disabled), greedy, {arrivals}"),
        "repeats": a.repeats,
        "machine": machine_info(),
        "command": " ".join(shlex.quote(x) for x in ["python", "scripts/bench_vs_peers.py", *(argv if argv is not None else sys.argv[1:])]),
    }
    rows = summarize_systems(systems)
    md = markdown_report(rows, meta)
    print(md)
    docs = None if a.no_docs else (a.docs or (None if a.smoke else REPO_ROOT / "docs" / "BENCHMARKS.md"))
    if docs is not None:
        replace_marked_section(docs, MARK_START, MARK_END, md, DOCS_HEADER)
        print(f"wrote {docs}")
    if a.json_out:
        a.json_out.write_text(json.dumps(bs._json_safe({"meta": meta, "rows": rows}), indent=2))
    print(f"total wall time {time.monotonic() - t_start:.1f} s")
    return 0 if any(r["repeats"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
