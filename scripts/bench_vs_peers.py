"""jaxserve against its peers on one model and one workload, interleaved and repeated (medians).

    python scripts/bench_vs_peers.py --model-preset bench-small --repeats 3
    python scripts/bench_vs_peers.py --workload bench-small-burst64     # a named workload (WORKLOADS)
    python scripts/bench_vs_peers.py --smoke --no-docs   # tiny model, 4 requests, 2 rates + the 80% run

Systems (choose with --systems):
  jaxserve      `python -m jaxserve.entrypoints.cli serve` with its own defaults (no tuning flags unless
                --jaxserve-args gives some), driven by bench_serving
  hf-static     Hugging Face transformers `generate`, static batches (left-padded, greedy, EOS suppressed)
  hf-serve      `transformers serve --continuous-batching`, driven by the same load generator
  llama-server  llama.cpp's `llama-server` (continuous batching, one slot per request in flight) on
                an f32 GGUF converted from the same model dir, driven by the same load generator;
                build it once with `bash scripts/setup_llama_cpp.sh` (skipped with a message if absent)
Every system gets the same text prompts and the same per-request output lengths (drawn once, seeded).
The run also measures the matmul rate and reports each system's share of the workload's compute
bound; the serving systems are swept over --rates and compared on TTFT at a fraction of jaxserve's
saturation. The markdown goes into docs/BENCHMARKS.md between the bench_vs_peers markers (other
sections are left untouched).
"""
from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import hashlib
import importlib.util
import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_serving as bs  # noqa: E402
from bench_common import (  # noqa: E402
    REPO_ROOT, free_port, http_ok, log_tail, machine_info, median, replace_marked_section, server_process,
)

if str(REPO_ROOT) not in sys.path:  # run from a checkout without `pip install -e .`
    sys.path.append(str(REPO_ROOT))

MARK_START = "<!-- bench_vs_peers:start -->"
MARK_END = "<!-- bench_vs_peers:end -->"


def section_markers(section: str | None) -> tuple[str, str]:
    """The markers of the docs section this run rewrites (one section per model / workload)."""
    if not section:
        return MARK_START, MARK_END
    return f"<!-- bench_vs_peers:{section}:start -->", f"<!-- bench_vs_peers:{section}:end -->"
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


# ----------------------------------------------------------------------------- launching jaxserve

def bench_env(torch_threads: int | None = None) -> dict[str, str]:
    """Environment for the servers we start: offline, this checkout importable, optional thread cap."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join(x for x in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if x))
    if torch_threads:
        env["OMP_NUM_THREADS"] = str(torch_threads)
    return env


def jaxserve_command(model_dir: Path, port: int, max_num_seqs: int | None = None,
                     max_num_batched_tokens: int | None = None, extra_args: str = "") -> list[str]:
    """`jaxserve serve` on 127.0.0.1:port for `model_dir` (float32) with jaxserve's own defaults.

    Tuning flags appear only when asked for: `max_num_seqs` / `max_num_batched_tokens` when not None,
    and the user's `extra_args` (buckets, KV-pool size, ...).
    """
    cmd = [sys.executable, "-m", "jaxserve.entrypoints.cli", "serve", "--model", str(model_dir), "--host", "127.0.0.1",
           "--port", str(port), "--dtype", "float32"]
    if max_num_seqs is not None:
        cmd += ["--max-num-seqs", str(max_num_seqs)]
    if max_num_batched_tokens is not None:
        cmd += ["--max-num-batched-tokens", str(max_num_batched_tokens)]
    return cmd + shlex.split(extra_args or "")


# ----------------------------------------------------------------------------- llama.cpp (llama-server)

LLAMA_CPP_SETUP = "scripts/setup_llama_cpp.sh"
GGUF_OUTTYPE = "f32"
# Tokens each llama-server slot holds beyond prompt_len_max + output_len_max: a text prompt can
# re-encode a few tokens longer than drawn (bench_serving._text_of_length), and a BOS may be added.
LLAMA_CTX_SLACK = 64
LLAMA_MAX_SLOTS = 256  # llama.cpp's LLAMA_MAX_SEQ; requests beyond the slots wait in llama-server's queue


def default_llama_cpp_home() -> Path:
    """Where scripts/setup_llama_cpp.sh installs: $LLAMA_CPP_HOME, else <jaxserve cache>/llama.cpp."""
    env = os.environ.get("LLAMA_CPP_HOME")
    if env:
        return Path(env).expanduser()
    cache = os.environ.get("JAXSERVE_CACHE")
    return (Path(cache).expanduser() if cache else Path.home() / ".cache" / "jaxserve") / "llama.cpp"


@dataclass(frozen=True)
class LlamaCpp:
    """The install setup_llama_cpp.sh leaves: bin/llama-server, convert_hf_to_gguf.py (+ gguf-py), VERSION."""
    home: Path

    @property
    def server(self) -> Path:
        return self.home / "bin" / "llama-server"

    @property
    def converter(self) -> Path:
        return self.home / "convert_hf_to_gguf.py"

    @property
    def version(self) -> str:
        try:
            return (self.home / "VERSION").read_text().strip() or "unknown"
        except OSError:
            return "unknown"

    def missing(self) -> str | None:
        """None when llama-server and the converter are installed, else the reason to skip the peer."""
        if not (self.server.is_file() and os.access(self.server, os.X_OK)):
            return (f"llama-server not found at {self.server}; build it once with "
                    f"`bash {LLAMA_CPP_SETUP}` (CPU; 6-15 min on 2 cores)")
        if not self.converter.is_file():
            return (f"convert_hf_to_gguf.py not found at {self.converter}; "
                    f"re-run `bash {LLAMA_CPP_SETUP} --force`")
        return None


def gguf_cache_key(model_dir: Path, tool_version: str, outtype: str = GGUF_OUTTYPE) -> str:
    """Hash of every (non-hidden) file in `model_dir` — names and contents — and of the converter
    version and outtype: the GGUF is converted again exactly when one of them changes."""
    h = hashlib.sha256(f"{tool_version}\0{outtype}\0".encode())
    for f in sorted(p for p in Path(model_dir).iterdir() if p.is_file() and not p.name.startswith(".")):
        h.update(f.name.encode() + b"\0")
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
        h.update(b"\0")
    return h.hexdigest()[:16]


def gguf_path(model_dir: Path, key: str, outtype: str = GGUF_OUTTYPE) -> Path:
    """The cached GGUF of `model_dir`: a file next to the dir, named by the dir and the cache key."""
    model_dir = Path(model_dir).resolve()
    return model_dir.parent / f"{model_dir.name}.{key}.{outtype}.gguf"


def gguf_convert_command(llama: LlamaCpp, model_dir: Path, out: Path, outtype: str = GGUF_OUTTYPE) -> list[str]:
    return [sys.executable, str(llama.converter), str(model_dir), "--outtype", outtype, "--outfile", str(out)]


def ensure_gguf(model_dir: Path, llama: LlamaCpp, log_path: Path, outtype: str = GGUF_OUTTYPE) -> Path:
    """The model as GGUF (`outtype`), converted by llama.cpp's own converter once per model content."""
    out = gguf_path(model_dir, gguf_cache_key(model_dir, llama.version, outtype), outtype)
    if out.is_file():
        return out
    tmp = out.with_name(f".{out.stem}.{os.getpid()}.tmp.gguf")
    env = dict(bench_env(), PYTHONPATH=os.pathsep.join(
        x for x in (str(llama.home / "gguf-py"), os.environ.get("PYTHONPATH")) if x))
    log_path.parent.mkdir(parents=True, exist_ok=True)
    print(f"converting {model_dir} to {outtype} GGUF (once per model) ...", flush=True)
    t = time.monotonic()
    with open(log_path, "wb") as log:
        rc = subprocess.run(gguf_convert_command(llama, model_dir, tmp, outtype), stdout=log,
                            stderr=subprocess.STDOUT, env=env).returncode
    if rc != 0 or not tmp.is_file():
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"convert_hf_to_gguf.py exited with {rc} (log {log_path}):\n{log_tail(log_path, 1500)}")
    os.replace(tmp, out)
    ours = re.compile(re.escape(Path(model_dir).resolve().name) + r"\.[0-9a-f]{16}\." + re.escape(outtype) + r"\.gguf")
    for stale in out.parent.iterdir():
        if stale != out and ours.fullmatch(stale.name):  # an earlier conversion of changed model files
            stale.unlink(missing_ok=True)
    print(f"wrote {out} in {time.monotonic() - t:.1f} s", flush=True)
    return out


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def llama_slot_context(prompt_len_max: int, output_len_max: int) -> int:
    """Context tokens one llama-server slot needs for the longest prompt plus the longest output."""
    return prompt_len_max + output_len_max + LLAMA_CTX_SLACK


def llama_server_command(server: Path, gguf: Path, port: int, n_parallel: int, slot_context: int,
                         threads: int, extra_args: str = "") -> list[str]:
    """`llama-server` on 127.0.0.1:port: `n_parallel` slots (one per request in flight), continuous
    batching, `-c` = the total context over all slots, f32 KV cache (every system runs float32),
    no host-RAM prompt cache (requests also send cache_prompt=false: no system reuses prompts)."""
    if n_parallel < 1 or slot_context < 1 or threads < 1:
        raise ValueError(f"need n_parallel, slot_context, threads >= 1, got {n_parallel}, {slot_context}, {threads}")
    return [str(server), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
            "-np", str(n_parallel), "-c", str(n_parallel * slot_context), "-t", str(threads), "--cont-batching",
            "-ctk", "f32", "-ctv", "f32", "--cache-ram", "0", *shlex.split(extra_args or "")]


def llama_server_config(base: bs.BenchConfig, port: int) -> bs.BenchConfig:
    """The load generator's config for llama-server: OpenAI /v1/completions with the same text
    prompts; `max_tokens` (llama-server's alias of n_predict) = the drawn output length and
    `ignore_eos` force it exactly; `cache_prompt: false` so repeats cannot reuse a slot's KV."""
    return replace(base, base_url=f"http://127.0.0.1:{port}", length_control="ignore_eos",
                   extra_body={**base.extra_body, "cache_prompt": False})


def length_problems(report: dict[str, Any]) -> str | None:
    """None when every completed request produced exactly its asked-for output tokens (by the
    server's usage.completion_tokens) and reused no cached prompt tokens; else what went wrong."""
    ok = [r for r in report["requests"] if r["ok"]]
    wrong = [r for r in ok if r["output_tokens"] != r["output_len_requested"]]
    cached = [r for r in ok if r.get("cached_tokens_reported")]
    problems = []
    if wrong:
        r = wrong[0]
        problems.append(f"{len(wrong)} of {len(ok)} requests did not generate their drawn output length "
                        f"(e.g. asked {r['output_len_requested']}, got {r['output_tokens']})")
    if cached:
        problems.append(f"{len(cached)} of {len(ok)} requests reused cached prompt tokens "
                        f"(e.g. {cached[0]['cached_tokens_reported']})")
    return "; ".join(problems) or None


# ----------------------------------------------------------------------------- compute bound

@dataclass(frozen=True)
class ComputeBound:
    """Seconds a workload needs at the measured matmul rate (roofline.workload_flops / rate)."""
    model_cfg: dict[str, Any]
    flop_rate: float  # FLOP/s

    def flops(self, prompt_lens: list[int], output_lens: list[int]) -> dict[str, int]:
        from roofline import workload_flops

        return workload_flops(self.model_cfg, prompt_lens, output_lens)

    def seconds(self, prompt_lens: list[int], output_lens: list[int]) -> float:
        if not prompt_lens:
            return math.nan
        return self.flops(prompt_lens, output_lens)["total"] / self.flop_rate


def pct_of_bound(bound_s: float, duration_s: float) -> float:
    """100 x the compute-bound time over the measured time (100 = as fast as the matmul rate allows)."""
    return 100.0 * bound_s / duration_s if duration_s > 0 else math.nan


# ----------------------------------------------------------------------------- systems

@dataclass
class Outcome:
    """One measurement of one system: the numbers the tables show (NaN where not applicable)."""
    output_throughput: float
    total_token_throughput: float
    request_throughput: float
    ttft_p50_ms: float = math.nan
    ttft_p99_ms: float = math.nan
    tpot_p50_ms: float = math.nan
    e2e_p50_ms: float = math.nan
    out_tokens_per_req: float = math.nan
    failed: int = 0
    duration_s: float = math.nan
    bound_s: float = math.nan        # compute bound of the requests this run completed
    pct_of_bound: float = math.nan   # 100 x bound_s / duration_s


@dataclass
class System:
    name: str
    measure: Callable[[float], Outcome]   # argument: arrival rate, req/s (inf = burst); static batching ignores it
    is_jaxserve: bool = False
    serving: bool = False                 # an HTTP server: takes part in the rate sweep and the 80% run
    outcomes: list[Outcome] = field(default_factory=list)             # at the main rate (burst)
    sweep: dict[float, list[Outcome]] = field(default_factory=dict)   # at the other rates of --rates
    at_frac: list[Outcome] = field(default_factory=list)              # at frac x jaxserve's saturation
    error: str | None = None
    frac_error: str | None = None


def outcome_from_report(report: dict[str, Any], bound: ComputeBound | None = None) -> Outcome:
    done = max(report["completed"], 1)
    ok = [r for r in report["requests"] if r["ok"]]
    bound_s = (bound.seconds([r["prompt_len"] for r in ok], [max(r["output_tokens"], 1) for r in ok])
               if bound is not None and ok else math.nan)
    return Outcome(
        output_throughput=report["output_throughput"], total_token_throughput=report["total_token_throughput"],
        request_throughput=report["request_throughput"], ttft_p50_ms=report["ttft_ms"]["p50"],
        ttft_p99_ms=report["ttft_ms"]["p99"], tpot_p50_ms=report["tpot_ms"]["p50"], e2e_p50_ms=report["e2e_ms"]["p50"],
        out_tokens_per_req=report["total_output_tokens"] / done, failed=report["failed"],
        duration_s=report["duration_s"], bound_s=bound_s, pct_of_bound=pct_of_bound(bound_s, report["duration_s"]),
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
    """Starts its server on first use (kept for all runs), warms it, then runs the load generator.
    Between its runs the server is stopped with SIGSTOP (SIGCONT before the next run and before it
    is shut down): another system's run shares these cores with no idle peer's threads.

    `fresh_cache_salt`: every run sends its own `cache_salt`, so a prefix-caching server cannot
    reuse the prompts of an earlier run (the same prompts are sent once per rate and repeat).
    `exact_lengths`: a run fails unless every request generated exactly its drawn output length
    (the server's usage.completion_tokens) without reusing cached prompt tokens.
    """

    def __init__(self, stack: contextlib.ExitStack, cmd: list[str], port: int, health_path: str,
                 cfg: bs.BenchConfig, prompts: list[bs.PromptSpec], log_path: Path, start_timeout: float,
                 env: dict[str, str], bound: ComputeBound | None = None, fresh_cache_salt: bool = False,
                 exact_lengths: bool = False):
        self.stack, self.cmd, self.port, self.cfg, self.prompts = stack, cmd, port, cfg, prompts
        self.health_url = f"http://127.0.0.1:{port}{health_path}"
        self.log_path, self.start_timeout, self.env = log_path, start_timeout, env
        self.bound, self.fresh_cache_salt, self.exact_lengths = bound, fresh_cache_salt, exact_lengths
        self.proc: subprocess.Popen | None = None  # the server, once started

    def _signal(self, sig: int) -> None:
        """sig to the server's process group (it runs in its own session), if it still runs."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)

    def _run_cfg(self, rate: float) -> bs.BenchConfig:
        extra = dict(self.cfg.extra_body)
        if self.fresh_cache_salt:
            extra["cache_salt"] = uuid.uuid4().hex
        return replace(self.cfg, request_rate=rate, extra_body=extra, json_out=None, plot_dir=None)

    def __call__(self, rate: float = math.inf) -> Outcome:
        if self.proc is None:
            if http_ok(self.health_url, timeout=1):
                raise RuntimeError(f"port {self.port} already serves something; not benchmarking a stranger")
            self.proc = self.stack.enter_context(server_process(self.cmd, self.health_url, self.log_path,
                                                                self.start_timeout, self.env))
            self.stack.callback(self._signal, signal.SIGCONT)  # runs first: a stopped server cannot exit
            self.cfg = replace(self.cfg, model=served_model_name(self.cfg.base_url, self.cfg.model))
            # Warm-up (not recorded): compilation, lazy model load, CB worker start.
            bs.run_benchmark(self._run_cfg(math.inf), prompts=self.prompts[:4])
        else:
            self._signal(signal.SIGCONT)
        try:
            report = bs.run_benchmark(self._run_cfg(rate), prompts=self.prompts)
        finally:
            self._signal(signal.SIGSTOP)
        if report["completed"] == 0:
            raise RuntimeError(f"every request failed: {report['errors']}")
        if report["failed"]:  # counted in the table; the reasons go to the log
            print(f"{report['failed']} of {report['num_requests']} requests failed: {report['errors']}", flush=True)
        if self.exact_lengths and (problem := length_problems(report)):
            raise RuntimeError(problem)
        return outcome_from_report(report, self.bound)


def unavailable(reason: str) -> Callable[[float], Outcome]:
    """The `measure` of a system that cannot run here (its System.error carries `reason`)."""
    def measure(rate: float = math.inf) -> Outcome:
        raise RuntimeError(reason)
    return measure


@dataclass
class StaticBatch:
    texts: list[str]
    output_lens: list[int]   # each request's own length; the batch generates max(output_lens)


def static_requests(n_total: int, batch_size: int, max_requests: int | None) -> int:
    """How many of the first requests a static batch size runs: all, or the first max_requests
    rounded up to one whole batch (a batch of 64 needs 64 requests to be one)."""
    if max_requests is None:
        return n_total
    return min(n_total, max(max_requests, batch_size))


def static_batches(prompts: list[bs.PromptSpec], batch_size: int) -> list[StaticBatch]:
    """Consecutive batches of `batch_size` requests (the last one may be smaller), each with its
    requests' own output lengths: the same PromptSpecs the load generator sends."""
    if batch_size < 1:
        raise ValueError(f"batch size must be >= 1, got {batch_size}")
    out = []
    for i in range(0, len(prompts), batch_size):
        chunk = prompts[i:i + batch_size]
        if any(not isinstance(p.prompt, str) for p in chunk):
            raise ValueError("static batching takes text prompts (prompt_as='text')")
        out.append(StaticBatch([str(p.prompt) for p in chunk], [p.output_len for p in chunk]))
    return out


class StaticGenerate:
    """transformers `generate` over fixed batches: left padding, greedy, EOS suppressed.

    A batch runs until its longest request is done; only each request's own tokens count as
    output (the surplus tokens of the shorter requests are the waste of static batching).
    """

    def __init__(self, model_dir: Path, prompts: list[bs.PromptSpec], batch_size: int,
                 bound: ComputeBound | None = None):
        self.model_dir, self.batch_size, self.prompts, self.bound = model_dir, batch_size, prompts, bound
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

    def _generate(self, texts: list[str], new_tokens: int) -> int:
        """Generate exactly `new_tokens` for every row; returns the real (unpadded) prompt tokens."""
        import torch

        tok, model = self._load()
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.inference_mode():
            out = model.generate(**enc, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                 pad_token_id=tok.pad_token_id)
        produced = out.shape[1] - enc["input_ids"].shape[1]
        if produced != new_tokens:
            raise RuntimeError(f"generate produced {produced} tokens, expected {new_tokens}")
        return int(enc["attention_mask"].sum())

    def __call__(self, rate: float = math.inf) -> Outcome:
        batches = static_batches(self.prompts, self.batch_size)
        if not self.warm:
            self._generate(batches[0].texts, 2)
            self.warm = True
        t = time.perf_counter()
        n_in = 0
        for b in batches:
            n_in += self._generate(b.texts, max(b.output_lens))
        elapsed = time.perf_counter() - t
        n_out = sum(p.output_len for p in self.prompts)
        n_req = len(self.prompts)
        bound_s = (self.bound.seconds([p.prompt_len for p in self.prompts], [p.output_len for p in self.prompts])
                   if self.bound is not None else math.nan)
        return Outcome(output_throughput=n_out / elapsed, total_token_throughput=(n_in + n_out) / elapsed,
                       request_throughput=n_req / elapsed, out_tokens_per_req=n_out / n_req,
                       duration_s=elapsed, bound_s=bound_s, pct_of_bound=pct_of_bound(bound_s, elapsed))


# ----------------------------------------------------------------------------- rates

def parse_rates(text: str) -> list[float]:
    """'inf,2,1,0.5' -> [inf, 2.0, 1.0, 0.5]; every rate > 0, no duplicates."""
    rates = [bs._rate(x.strip()) for x in text.split(",") if x.strip()]
    if not rates or any(not r > 0 for r in rates):
        raise ValueError(f"--rates needs rates > 0 (inf = burst), got {text!r}")
    if len(set(rates)) != len(rates):
        raise ValueError(f"--rates lists a rate twice: {text!r}")
    return rates


def main_rate(rates: list[float]) -> float:
    """The rate of the main table (and of hf-static's row): the burst when swept, else the first."""
    return math.inf if math.inf in rates else rates[0]


def saturation_rate(systems: list[System]) -> float:
    """jaxserve's burst request throughput (median over repeats); NaN when it was not measured."""
    for s in systems:
        if s.is_jaxserve:
            return median([o.request_throughput for o in s.outcomes]) if s.outcomes else math.nan
    return math.nan


def frac_rate(saturation_req_s: float, frac: float) -> float:
    """The arrival rate of the TTFT comparison: frac x the measured saturation (req/s)."""
    if not 0 < frac <= 1:
        raise ValueError(f"the saturation fraction must be in (0, 1], got {frac}")
    if not (math.isfinite(saturation_req_s) and saturation_req_s > 0):
        raise ValueError(f"no measured saturation rate to take a fraction of (got {saturation_req_s})")
    return frac * saturation_req_s


def rate_label(rate: float) -> str:
    return "burst" if rate == math.inf else f"{rate:.3g}"


# ----------------------------------------------------------------------------- report

def _fmt(x: float | None, digits: int = 1) -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def median_row(outcomes: list[Outcome]) -> dict[str, float]:
    """Every Outcome field as its median over `outcomes` (NaN when there are none)."""
    return {key: (median([getattr(o, key) for o in outcomes]) if outcomes else math.nan)
            for key in Outcome.__dataclass_fields__}


def summarize_systems(systems: list[System]) -> list[dict[str, Any]]:
    """Main-table rows: medians over repeats of each system's runs at the main rate."""
    return [{"system": s.name, "is_jaxserve": s.is_jaxserve, "repeats": len(s.outcomes), "error": s.error,
             **median_row(s.outcomes)} for s in systems]


def summarize_sweep(systems: list[System], rates: list[float]) -> list[dict[str, Any]]:
    """One row per serving system and rate (main rate from `outcomes`, the rest from `sweep`)."""
    rows = []
    main = main_rate(rates)
    for s in systems:
        if not s.serving:
            continue
        for rate in rates:
            runs = s.outcomes if rate == main else s.sweep.get(rate, [])
            if runs:
                rows.append({"system": s.name, "is_jaxserve": s.is_jaxserve, "rate": rate,
                             "offered": rate_label(rate), "repeats": len(runs),
                             **median_row(runs)})
    return rows


def summarize_frac(systems: list[System]) -> list[dict[str, Any]]:
    return [{"system": s.name, "is_jaxserve": s.is_jaxserve, "repeats": len(s.at_frac), "error": s.frac_error,
             **median_row(s.at_frac)} for s in systems if s.serving and (s.at_frac or s.frac_error)]


def bound_lines(bound: dict[str, Any] | None) -> list[str]:
    if not bound:
        return []
    return [f"- compute bound of the workload: {bound['gflop']:.1f} GFLOP (prefill {bound['prefill_gflop']:.1f}, "
            f"decode {bound['decode_gflop']:.1f}; of which lm_head {bound['lm_head_gflop']:.1f}) at the measured "
            f"matmul rate {bound['gflops']:.1f} GFLOP/s ({bound['rate_source']}) = **{bound['seconds']:.2f} s**; "
            f"\"% of bound\" = a system's bound seconds for the requests it ran / its measured duration"]


def markdown_report(rows: list[dict[str, Any]], meta: dict[str, Any], sweep_rows: list[dict[str, Any]] | None = None,
                    frac: dict[str, Any] | None = None) -> str:
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
        *(f"- {n}" for n in meta.get("systems", [])),
        *bound_lines(meta.get("bound")),
        "",
        "| system | output tok/s | total tok/s | req/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | E2E p50 ms "
        "| out tok/req | failed | % of bound | jaxserve ÷ system (output tok/s) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if not r["repeats"]:
            continue
        ratio = "—" if r["is_jaxserve"] else _fmt(jax_tput / r["output_throughput"], 2)
        lines.append(
            f"| {r['system']} | {_fmt(r['output_throughput'])} | {_fmt(r['total_token_throughput'])} "
            f"| {_fmt(r['request_throughput'], 2)} | {_fmt(r['ttft_p50_ms'])} | {_fmt(r['ttft_p99_ms'])} "
            f"| {_fmt(r['tpot_p50_ms'])} | {_fmt(r['e2e_p50_ms'])} | {_fmt(r['out_tokens_per_req'])} "
            f"| {_fmt(r['failed'], 0)} | {_fmt(r['pct_of_bound'])} | {ratio} |"
        )
    lines.append("")
    if best is not None and jax_rows:
        lines.append(f"**jaxserve / best peer ({best['system']}), output tok/s: "
                     f"{_fmt(jax_tput / best['output_throughput'], 2)}**; jaxserve at "
                     f"{_fmt(jax_rows[0]['pct_of_bound'])}% of the compute bound")
    elif best is not None:
        lines.append(f"jaxserve was not measured; best peer: {best['system']} at "
                     f"{_fmt(best['output_throughput'])} output tok/s")
    for r in rows:
        if r["error"]:
            lines.append(f"- not measured: {r['system']} — {r['error']}")
    if sweep_rows and len({r["rate"] for r in sweep_rows}) > 1:
        lines += ["", "Rate sweep (Poisson arrivals at the offered rate; burst = all at t=0):", "",
                  "| system | offered req/s | achieved req/s | output tok/s | TTFT p50 ms | TTFT p99 ms "
                  "| TPOT p50 ms | E2E p50 ms | failed |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in sweep_rows:
            lines.append(f"| {r['system']} | {rate_label(r['rate'])} | {_fmt(r['request_throughput'], 2)} "
                         f"| {_fmt(r['output_throughput'])} | {_fmt(r['ttft_p50_ms'])} | {_fmt(r['ttft_p99_ms'])} "
                         f"| {_fmt(r['tpot_p50_ms'])} | {_fmt(r['e2e_p50_ms'])} | {_fmt(r['failed'], 0)} |")
    if frac:
        lines += ["", *frac_lines(frac)]
    lines += ["", "Machine: " + ", ".join(f"{k} {v}" for k, v in meta["machine"].items()), "",
              f"Command: `{meta['command']}`"]
    return "\n".join(lines)


def frac_lines(frac: dict[str, Any]) -> list[str]:
    """The TTFT-at-a-fraction-of-saturation table (or the reason it is missing)."""
    if frac.get("skipped"):
        return [f"TTFT at {frac['frac']:g} x saturation: not measured — {frac['skipped']}"]
    rows = frac["rows"]
    lines = [f"TTFT at {frac['frac']:g} x jaxserve's saturation: Poisson {frac['rate']:.3g} req/s "
             f"(saturation = jaxserve's burst throughput, {frac['saturation']:.3g} req/s):", "",
             "| system | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | output tok/s | failed | TTFT p99 ÷ jaxserve's |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    jax = next((r for r in rows if r["is_jaxserve"] and r["repeats"]), None)
    for r in rows:
        if not r["repeats"]:
            continue
        ratio = "—" if r["is_jaxserve"] or jax is None else _fmt(r["ttft_p99_ms"] / jax["ttft_p99_ms"], 2)
        lines.append(f"| {r['system']} | {_fmt(r['ttft_p50_ms'])} | {_fmt(r['ttft_p99_ms'])} | {_fmt(r['tpot_p50_ms'])} "
                     f"| {_fmt(r['output_throughput'])} | {_fmt(r['failed'], 0)} | {ratio} |")
    peers = [r for r in rows if not r["is_jaxserve"] and r["repeats"]]
    if jax is not None and peers:
        lower = all(jax["ttft_p99_ms"] < r["ttft_p99_ms"] for r in peers)
        lines += ["", f"jaxserve's TTFT p99 is {'lower' if lower else 'NOT lower'} than every peer's at this rate."]
    lines += [f"- not measured at this rate: {r['system']} — {r['error']}" for r in rows if r["error"]]
    return lines


# ----------------------------------------------------------------------------- main

SYSTEMS = ("jaxserve", "hf-static", "hf-serve", "llama-server")

# Named workloads (--workload): the model and the request mix of one comparison. Explicit flags
# override any of these; the docs section defaults to the workload's name.
WORKLOADS: dict[str, dict[str, Any]] = {
    "bench-small-burst64": dict(model_preset="bench-small", num_requests=64, prompt_len_min=30, prompt_len_max=500,
                                output_len_min=16, output_len_max=128, hf_static_max_requests=16),
    "bench-105m-burst128": dict(model_preset="bench-105m", num_requests=128, prompt_len_min=64, prompt_len_max=1024,
                                output_len_min=32, output_len_max=256, hf_static_max_requests=16),
}
# Without --workload / --smoke.
DEFAULTS = dict(num_requests=32, prompt_len_min=32, prompt_len_max=256, output_len=64)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", help="local HF model dir (config.json, safetensors, tokenizer files)")
    src.add_argument("--model-preset", choices=sorted(PRESETS))
    p.add_argument("--workload", choices=sorted(WORKLOADS),
                   help="a named comparison: " + "; ".join(
                       f"{k} = {v['model_preset']}, {v['num_requests']}-request burst, prompts "
                       f"{v['prompt_len_min']}-{v['prompt_len_max']}, outputs {v['output_len_min']}-{v['output_len_max']}"
                       for k, v in WORKLOADS.items()))
    p.add_argument("--cache-dir", type=Path, help="where presets are written (default ~/.cache/jaxserve/bench-models)")
    p.add_argument("--tokenizer-source", type=Path, help="dir whose tokenizer files presets copy (default: the embedded default model)")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, from {', '.join(SYSTEMS)}")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--num-requests", type=int, help=f"default {DEFAULTS['num_requests']}")
    p.add_argument("--prompt-len-min", type=int, help=f"default {DEFAULTS['prompt_len_min']}")
    p.add_argument("--prompt-len-max", type=int, help=f"default {DEFAULTS['prompt_len_max']}")
    p.add_argument("--output-len", type=int, help=f"fixed output length (shortcut for min = max; default {DEFAULTS['output_len']})")
    p.add_argument("--output-len-min", type=int, help="output lengths drawn uniformly from [min, max] (default --output-len)")
    p.add_argument("--output-len-max", type=int)
    p.add_argument("--request-rate", type=bs._rate, help="one arrival rate (req/s, inf = burst); same as --rates RATE")
    p.add_argument("--rates", help="arrival rates for the serving systems, e.g. inf,2,1,0.5 (default inf); "
                                   "the main table is the burst run (else the first rate)")
    p.add_argument("--ttft-at-saturation-frac", type=float, default=0.8,
                   help="run the serving systems again at this fraction of jaxserve's burst req/s and compare "
                        "TTFT (needs inf in --rates; 0 disables)")
    p.add_argument("--max-concurrency", type=int, help="requests in flight at most (also llama-server's slot count)")
    p.add_argument("--batch-sizes", default="1,16,64", help="static-batching sizes for hf-static")
    p.add_argument("--hf-static-max-requests", type=int,
                   help="hf-static runs only the first N requests (at least one whole batch) per batch size")
    p.add_argument("--max-num-seqs", type=int, help="opt-in jaxserve tuning flag (default: jaxserve's own)")
    p.add_argument("--max-num-batched-tokens", type=int, help="opt-in jaxserve tuning flag (default: jaxserve's own)")
    p.add_argument("--jaxserve-args", default=None,
                   help="extra `jaxserve serve` flags (buckets, KV pool, context), one string; opt-in: by default "
                        "jaxserve runs with its own defaults")
    p.add_argument("--llama-cpp-home", type=Path, default=None,
                   help="where scripts/setup_llama_cpp.sh installed llama.cpp (default $LLAMA_CPP_HOME or "
                        "~/.cache/jaxserve/llama.cpp)")
    p.add_argument("--llama-server-args", default="", help="extra `llama-server` flags, one string")
    p.add_argument("--matmul-gflops", type=float, help="skip the matmul-rate measurement: use this GFLOP/s")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--torch-threads", type=int, help="torch intra-op threads for hf-static and hf-serve (default: torch's)")
    p.add_argument("--start-timeout", type=float, default=600.0, help="seconds a server may take to become healthy")
    p.add_argument("--timeout", type=float, default=1800.0, help="bound on each load-generator run, seconds")
    p.add_argument("--docs", type=Path, help="markdown file to update (default docs/BENCHMARKS.md; none in --smoke)")
    p.add_argument("--no-docs", action="store_true")
    p.add_argument("--docs-section", help="name of the marked docs section to rewrite (default: the --workload's "
                                          "name, else the unnamed one)")
    p.add_argument("--json-out", type=Path)
    p.add_argument("--log-dir", type=Path, default=Path(tempfile.gettempdir()) / "bench_vs_peers_logs")
    p.add_argument("--smoke", action="store_true",
                   help="tiny model, 4 requests, 1 repeat, hf-static bs=1 on 2 requests, rates inf,4 + the 80%% run")
    a = p.parse_args(argv)
    if a.request_rate is not None and a.rates is not None:
        raise ValueError("give --request-rate or --rates, not both")
    if a.smoke and a.workload:
        raise ValueError("give --smoke or --workload, not both")
    if a.smoke:
        if not a.model and not a.model_preset:
            a.model_preset = "tiny"
        a.repeats, a.num_requests, a.batch_sizes, a.hf_static_max_requests = 1, 4, "1", 2
        a.prompt_len_min, a.prompt_len_max = 16, 32
        a.output_len, a.output_len_min, a.output_len_max = 8, 4, 8
        a.systems = ",".join(s for s in a.systems.split(",") if s != "hf-serve")
        if a.rates is None and a.request_rate is None:
            a.rates = "inf,4"
        a.start_timeout, a.timeout = min(a.start_timeout, 120.0), min(a.timeout, 30.0)
    if a.workload:
        w = WORKLOADS[a.workload]
        if not a.model and not a.model_preset:
            a.model_preset = w["model_preset"]
        for key in ("num_requests", "prompt_len_min", "prompt_len_max", "hf_static_max_requests"):
            if getattr(a, key) is None:
                setattr(a, key, w[key])
        if a.output_len is None and a.output_len_min is None and a.output_len_max is None:
            a.output_len_min, a.output_len_max = w["output_len_min"], w["output_len_max"]
        if a.docs_section is None:
            a.docs_section = a.workload
    if not a.model and not a.model_preset:
        a.model_preset = "bench-small"
    for key, value in DEFAULTS.items():
        if getattr(a, key) is None:
            setattr(a, key, value)
    if a.llama_cpp_home is None:
        a.llama_cpp_home = default_llama_cpp_home()
    a.output_len_min = a.output_len if a.output_len_min is None else a.output_len_min
    a.output_len_max = a.output_len if a.output_len_max is None else a.output_len_max
    if not 1 <= a.output_len_min <= a.output_len_max:
        raise ValueError(f"need 1 <= --output-len-min <= --output-len-max, got {a.output_len_min}, {a.output_len_max}")
    a.rate_list = parse_rates(a.rates) if a.rates is not None else [a.request_rate or math.inf]
    if a.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {a.repeats}")
    if not 0 <= a.ttft_at_saturation_frac <= 1:
        raise ValueError(f"--ttft-at-saturation-frac must be in [0, 1], got {a.ttft_at_saturation_frac}")
    if a.hf_static_max_requests is not None and a.hf_static_max_requests < 1:
        raise ValueError(f"--hf-static-max-requests must be >= 1, got {a.hf_static_max_requests}")
    unknown = set(a.systems.split(",")) - set(SYSTEMS)
    if unknown:
        raise ValueError(f"unknown systems {sorted(unknown)}; choose from {', '.join(SYSTEMS)}")
    return a


def measure_bound(a: argparse.Namespace, model_dir: Path, prompts: list[bs.PromptSpec]) -> tuple[ComputeBound, dict[str, Any]]:
    """The matmul rate (measured now unless --matmul-gflops) and the whole workload's compute bound."""
    from roofline import _load_config, measure_matmul_rate

    if a.matmul_gflops:
        rate, source = a.matmul_gflops * 1e9, "given by --matmul-gflops"
    else:
        rate, n = measure_matmul_rate(sizes=(128, 256) if a.smoke else (512, 1024, 2048))
        source = f"float32 jnp.dot {n}x{n}, measured at the start of this run"
    bound = ComputeBound(_load_config(model_dir), rate)
    flops = bound.flops([p.prompt_len for p in prompts], [p.output_len for p in prompts])
    info = {"gflop": flops["total"] / 1e9, "prefill_gflop": flops["prefill"] / 1e9,
            "decode_gflop": flops["decode"] / 1e9, "lm_head_gflop": flops["lm_head"] / 1e9,
            "gflops": rate / 1e9, "seconds": flops["total"] / rate, "rate_source": source,
            "prompt_tokens": flops["prompt_tokens"], "output_tokens": flops["output_tokens"]}
    print(f"matmul rate {rate / 1e9:.1f} GFLOP/s; workload {info['gflop']:.1f} GFLOP -> compute bound "
          f"{info['seconds']:.2f} s", flush=True)
    return bound, info


def build_systems(a: argparse.Namespace, stack: contextlib.ExitStack, model_dir: Path, base: bs.BenchConfig,
                  prompts: list[bs.PromptSpec], bound: ComputeBound) -> list[System]:
    wanted = a.systems.split(",")
    env = bench_env()
    systems: list[System] = []
    if "jaxserve" in wanted:
        port = free_port()
        cmd = jaxserve_command(model_dir, port, a.max_num_seqs, a.max_num_batched_tokens, a.jaxserve_args or "")
        cfg = replace(base, base_url=f"http://127.0.0.1:{port}", length_control="ignore_eos")
        s = System("jaxserve (continuous batching)", ServerSystem(
            stack, cmd, port, "/health", cfg, prompts, a.log_dir / "jaxserve.log", a.start_timeout, env,
            bound=bound, fresh_cache_salt=True), is_jaxserve=True, serving=True)
        if importlib.util.find_spec("jaxserve.entrypoints.cli") is None:
            s.error = "jaxserve.entrypoints.cli is not importable yet"
        systems.append(s)
    if "hf-serve" in wanted:
        port = free_port()
        exe = shutil.which("transformers") or "transformers"
        cmd = [exe, "serve", str(model_dir), "--continuous-batching", "--device", "cpu", "--dtype", "float32",
               "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
        # `transformers serve` rejects unknown fields (ignore_eos): its own generation_config forces the length.
        cfg = replace(base, base_url=f"http://127.0.0.1:{port}", length_control="hf_generation_config")
        s = System("transformers serve --continuous-batching", ServerSystem(
            stack, cmd, port, "/health", cfg, prompts, a.log_dir / "transformers_serve.log", a.start_timeout,
            bench_env(a.torch_threads), bound=bound), serving=True)
        if importlib.util.find_spec("fastapi") is None:
            s.error = "`transformers serve` needs fastapi, which is not installed"
        systems.append(s)
    if "llama-server" in wanted:
        systems.append(llama_server_system(a, stack, model_dir, base, prompts, bound))
    if "hf-static" in wanted:
        for b in (int(x) for x in a.batch_sizes.split(",")):
            n = static_requests(len(prompts), b, a.hf_static_max_requests)
            label = f"transformers generate, static batch {b}"
            if n < len(prompts):
                label += f" (first {n} of {len(prompts)} requests)"
            systems.append(System(label, StaticGenerate(model_dir, prompts[:n], b, bound)))
    return systems


LLAMA_SERVER_LABEL = "llama.cpp llama-server (continuous batching)"


def llama_server_system(a: argparse.Namespace, stack: contextlib.ExitStack, model_dir: Path, base: bs.BenchConfig,
                        prompts: list[bs.PromptSpec], bound: ComputeBound | None) -> System:
    """The llama-server peer: one slot per request that can be in flight (--max-concurrency, else
    every request of the burst; at most LLAMA_MAX_SLOTS), each slot sized for the longest prompt +
    output. Without the binary it is a System whose error says how to build it."""
    llama = LlamaCpp(a.llama_cpp_home)
    missing = llama.missing()
    if missing:
        print(f"llama-server: skipped — {missing}", flush=True)
        s = System(LLAMA_SERVER_LABEL, unavailable(missing), serving=True)
        s.error = missing
        return s
    try:
        gguf = ensure_gguf(model_dir, llama, a.log_dir / "convert_hf_to_gguf.log")
    except Exception as exc:  # a failed conversion skips this peer, not the run
        s = System(LLAMA_SERVER_LABEL, unavailable(str(exc)), serving=True)
        s.error = f"GGUF conversion failed: {str(exc).splitlines()[0][:300]}"
        return s
    port = free_port()
    n_parallel = min(a.max_concurrency or len(prompts), LLAMA_MAX_SLOTS)
    cmd = llama_server_command(llama.server, gguf, port, n_parallel,
                               llama_slot_context(a.prompt_len_max, a.output_len_max), usable_cores(),
                               a.llama_server_args)
    a.llama_server_cmd = cmd  # for the report
    return System(LLAMA_SERVER_LABEL, ServerSystem(
        stack, cmd, port, "/health", llama_server_config(base, port), prompts, a.log_dir / "llama_server.log",
        a.start_timeout, bench_env(), bound=bound, exact_lengths=True), serving=True)


def system_notes(a: argparse.Namespace, llama_cpp_version: str | None = None) -> list[str]:
    """One line per system's configuration, for the report."""
    wanted = a.systems.split(",")
    notes = []
    if "jaxserve" in wanted:
        flags = " ".join(x for x in (
            f"--max-num-seqs {a.max_num_seqs}" if a.max_num_seqs is not None else "",
            f"--max-num-batched-tokens {a.max_num_batched_tokens}" if a.max_num_batched_tokens is not None else "",
            a.jaxserve_args or "") if x)
        notes.append("jaxserve: `jaxserve serve --dtype float32` " + (f"with `{flags}`" if flags else
                                                                       "with its default settings (no tuning flags)"))
    cmd = getattr(a, "llama_server_cmd", None)
    if "llama-server" in wanted and cmd:
        shown = " ".join(shlex.quote(x) for x in cmd[cmd.index("-np"):])
        notes.append(f"llama-server: llama.cpp from the {llama_cpp_version or 'llama-cpp-python'} sdist, CPU build "
                     f"(GGML_NATIVE), float32 GGUF from its convert_hf_to_gguf.py, `{shown}`; requests send "
                     f"`ignore_eos` and `cache_prompt: false`")
    return notes


def run_once(s: System, rate: float, tag: str, into: list[Outcome]) -> None:
    """One measurement appended to `into`; a failure disables the system for the rest of the run."""
    try:
        o = s.measure(rate)
        into.append(o)
        print(f"[{tag}] {s.name}: {o.output_throughput:.1f} output tok/s, {o.request_throughput:.2f} req/s, "
              f"TTFT p99 {_fmt(o.ttft_p99_ms)} ms, {_fmt(o.pct_of_bound)}% of bound", flush=True)
    except Exception as exc:  # a system that cannot run is reported, not fatal
        s.error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
        print(f"[{tag}] {s.name}: FAILED {s.error}", flush=True)


def run_frac(systems: list[System], a: argparse.Namespace) -> dict[str, Any] | None:
    """The serving systems once more per repeat at frac x jaxserve's measured saturation."""
    frac = a.ttft_at_saturation_frac
    if not frac:
        return None
    if math.inf not in a.rate_list:
        return {"frac": frac, "skipped": "no burst (inf) run in --rates to measure saturation"}
    try:
        rate = frac_rate(saturation_rate(systems), frac)
    except ValueError as exc:
        return {"frac": frac, "skipped": f"jaxserve's burst run gave no saturation rate ({exc})"}
    print(f"saturation {saturation_rate(systems):.3f} req/s -> TTFT runs at {rate:.3f} req/s", flush=True)
    serving = [s for s in systems if s.serving and not s.error]
    for rep in range(a.repeats):
        for s in serving:
            if s.frac_error:
                continue
            try:
                s.at_frac.append(s.measure(rate))
                o = s.at_frac[-1]
                print(f"[{frac:g} x saturation, repeat {rep + 1}/{a.repeats}] {s.name}: TTFT p50 "
                      f"{_fmt(o.ttft_p50_ms)} ms, p99 {_fmt(o.ttft_p99_ms)} ms", flush=True)
            except Exception as exc:
                s.frac_error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
    return {"frac": frac, "saturation": saturation_rate(systems), "rate": rate, "rows": summarize_frac(systems)}


def workload_text(a: argparse.Namespace, n: int) -> str:
    outputs = (f"{a.output_len_min} output tokens each" if a.output_len_min == a.output_len_max
               else f"{a.output_len_min}–{a.output_len_max} output tokens per request (uniform)")
    rates = ", ".join(rate_label(r) for r in a.rate_list)
    arrivals = f"arrival rates swept: {rates} req/s (Poisson; burst = all at t=0)" if len(a.rate_list) > 1 else (
        "burst (all at t=0)" if a.rate_list[0] == math.inf else f"Poisson {a.rate_list[0]:g} req/s")
    if a.max_concurrency:
        arrivals += f", at most {a.max_concurrency} in flight"
    return (f"{n} requests, prompts {a.prompt_len_min}–{a.prompt_len_max} tokens of repository text (seed {a.seed}), "
            f"{outputs}, EOS disabled, greedy, {arrivals}")


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    t_start = time.monotonic()
    model_dir = Path(a.model) if a.model else ensure_preset(a.model_preset, a.cache_dir, a.tokenizer_source)
    if not (model_dir / "config.json").is_file():
        raise ValueError(f"{model_dir} is not a model dir (no config.json)")
    base = bs.BenchConfig(
        base_url="", model=str(model_dir), tokenizer=str(model_dir), endpoint="completions",
        num_requests=a.num_requests, request_rate=math.inf, max_concurrency=a.max_concurrency,
        prompt_len_min=a.prompt_len_min, prompt_len_max=a.prompt_len_max,
        output_len_min=a.output_len_min, output_len_max=a.output_len_max, prompt_as="text", seed=a.seed,
        timeout=a.timeout,
    )
    # One prompt set for every system: text, so that `transformers serve` (text only) gets the same
    # input, and each request's output length, which hf-static uses too.
    prompts = bs.build_prompts(base, bs.load_tokenizer(str(model_dir)))
    bound, bound_info = measure_bound(a, model_dir, prompts)
    if a.torch_threads:
        import torch

        torch.set_num_threads(a.torch_threads)

    main = main_rate(a.rate_list)
    with contextlib.ExitStack() as stack:
        systems = build_systems(a, stack, model_dir, base, prompts, bound)
        for rep in range(a.repeats):
            for rate in a.rate_list:
                for s in systems:
                    if s.error or not (s.serving or rate == main):
                        continue
                    into = s.outcomes if rate == main else s.sweep.setdefault(rate, [])
                    run_once(s, rate, f"repeat {rep + 1}/{a.repeats}, rate {rate_label(rate)}", into)
        frac = run_frac(systems, a)

    meta = {
        "date": dt.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "model": a.model_preset or str(model_dir),
        "model_desc": describe_model(model_dir),
        "workload": workload_text(a, len(prompts)),
        "repeats": a.repeats,
        "systems": system_notes(a, LlamaCpp(a.llama_cpp_home).version),
        "bound": bound_info,
        "machine": machine_info(),
        "command": " ".join(shlex.quote(x) for x in ["python", "scripts/bench_vs_peers.py", *(argv if argv is not None else sys.argv[1:])]),
    }
    rows = summarize_systems(systems)
    sweep_rows = summarize_sweep(systems, a.rate_list)
    md = markdown_report(rows, meta, sweep_rows, frac)
    print(md)
    docs = None if a.no_docs else (a.docs or (None if a.smoke else REPO_ROOT / "docs" / "BENCHMARKS.md"))
    if docs is not None:
        replace_marked_section(docs, *section_markers(a.docs_section), md, DOCS_HEADER)
        print(f"wrote {docs}")
    if a.json_out:
        a.json_out.parent.mkdir(parents=True, exist_ok=True)
        a.json_out.write_text(json.dumps(bs._json_safe(
            {"meta": meta, "rows": rows, "sweep_rows": sweep_rows, "ttft_at_saturation_frac": frac}), indent=2))
    print(f"total wall time {time.monotonic() - t_start:.1f} s")
    return 0 if any(r["repeats"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
