"""`jaxserve serve | generate | plan | convert | bench`: argparse -> EngineConfig / ServerConfig -> server/.

Engine sizes left unset (None) are chosen from the machine and the model when the engine starts
(jaxserve/capacity.py); an explicit flag always wins.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys

from jaxserve.config import LOAD_FORMATS
from jaxserve.multihost import DEFAULT_STALL_TIMEOUT
from jaxserve.quant.kv import KV_CACHE_DTYPES

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


def _size(text: str) -> int:
    """'268435456', '256MiB', '2GB' -> bytes."""
    m = _SIZE.match(text)
    unit = (m.group(2) or "").lower() if m else None
    if m is None or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"invalid size {text!r} (e.g. 268435456, 256MiB, 2GB)")
    return int(float(m.group(1)) * _UNITS[unit])


def _buckets(text: str) -> tuple[int, ...] | None:
    """'16,64,256' -> (16, 64, 256); 'auto' -> None (powers of two)."""
    if text == "auto":
        return None
    try:
        values = tuple(sorted({int(v) for v in text.split(",") if v.strip()}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid bucket list {text!r} (e.g. 16,64,256 or auto)") from None
    if not values or values[0] < 1:
        raise argparse.ArgumentTypeError(f"bucket list {text!r} must hold positive integers")
    return values


def _mesh(text: str) -> tuple[int, int]:
    from jaxserve.sharding import parse_mesh
    try:
        return parse_mesh(text.strip())
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _prefill_decode(text: str) -> tuple[int, int]:
    """P:D, the prefill and decode instances of --disaggregate."""
    try:
        prefill, decode = (int(n) for n in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected P:D (e.g. 1:1), got {text!r}") from None
    if prefill < 1 or decode < 1:
        raise argparse.ArgumentTypeError(f"needs at least one prefill and one decode instance, got {text!r}")
    return prefill, decode


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def _engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None, help="HF model directory or cached hub id (default: the embedded "
                   "jaxserve-tiny model, random weights)")
    _size_args(g)
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="share KV pages of identical prompt prefixes between requests")
    g.add_argument("--kv-role", choices=("prefill", "decode"), default=None, help="prefill/decode "
                   "disaggregation: a prefill instance exports its prompts' KV pages (POST /v1/kv/export); a decode "
                   "instance imports them for requests that name it in kv_transfer_params (`jaxserve proxy` does "
                   "both) (default: neither)")
    g.add_argument("--kv-offload-gib", type=_positive_float, default=None, help="a host-memory KV tier of this "
                   "many GiB: cached pages evicted from the device move there and come back on a prefix hit, and a "
                   "preempted sequence's pages come back instead of being recomputed; needs prefix caching "
                   "(default: off)")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                   help="plan and dispatch step n+1 before step n's tokens are fetched")
    g.add_argument("--tensor-parallel-size", type=int, default=None, help="shorthand for --mesh 1xN "
                   "(default: from --mesh)")
    g.add_argument("--mesh", type=_mesh, default=None, help="device mesh DATAxMODEL (default: 1x1)")
    g.add_argument("--layout", default="tp", help="how the mesh splits the model (jaxserve/layouts.py): tp, "
                   "tp-ep (MoE: whole experts over the model axis, tokens dispatched to them by all-to-all), "
                   "tp-ep-data (MoE, EP x TP: experts over the data axis, each expert's width over the model "
                   "axis), tp-vocab-replicated, tp-kv-replicated")
    g.add_argument("--dtype", default="auto", help="auto (float32 on CPU, else the checkpoint's), float32, "
                   "bfloat16, float16")
    _quantization_arg(g)
    g.add_argument("--load-format", choices=LOAD_FORMATS, default="auto", help="auto: read the checkpoint's "
                   "weights; dummy: random weights drawn on the devices from config.json alone (benchmarks at a "
                   "model's shape without its weights: only config.json and the tokenizer are read)")
    g.add_argument("--scheduling-policy", choices=("fcfs", "priority"), default="fcfs",
                   help="waiting order: arrival, or the request's priority (lower first) then arrival")
    g.add_argument("--attention-backend", choices=("auto", "reference", "tiled", "cpu", "tpu", "gpu"), default="auto",
                   help="attention implementation; auto picks the platform's kernel (on CPU: 'cpu', the tiled jnp "
                        "path with a native decode kernel built at first use, or 'tiled' where no compiler is)")
    g.add_argument("--compilation-cache-dir", default=None, help="persistent XLA compilation cache directory; "
                   "'' turns it off (default: $XDG_CACHE_HOME or ~/.cache, then jaxserve/xla)")
    g.add_argument("--max-waiting-requests", type=int, default=1024,
                   help="queued sequences beyond which new requests get 429")
    g.add_argument("--seed", type=int, default=0, help="seeds the random seeds of requests that bring none")
    g.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters on the base model")
    g.add_argument("--lora-modules", nargs="+", type=_lora_module, default=[], metavar="NAME=PATH",
                   help="PEFT adapters (directories with adapter_config.json + adapter_model.safetensors, or hub "
                   "ids in the local Hugging Face cache) loaded at start-up; a request selects one by its model field")
    g.add_argument("--max-loras", type=int, default=4, help="adapter slots on the device")
    g.add_argument("--max-lora-rank", type=int, default=16, help="largest adapter rank (every slot is this wide)")
    g.add_argument("--max-cpu-loras", type=int, default=None, help="adapters kept in host memory, least recently "
                   "used evicted (re-read from disk when a slot needs them) (default: --max-loras)")
    g.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, vLLM\'s JSON shape, e.g. \'{"method": "ngram", '
                   '"num_speculative_tokens": 4, "prompt_lookup_max": 4}\' (prompt lookup: drafts copied from '
                   'the sequence\'s own earlier tokens) or \'{"method": "draft_model", "model": DIR, '
                   '"num_speculative_tokens": 4}\' (a smaller model with the same tokenizer proposes) or '
                   '\'{"method": "eagle3", "model": DIR, "num_speculative_tokens": 4}\' (an EAGLE-3 head trained '
                   'for the model, in the Hugging Face layout, reads its hidden states); drafts are verified '
                   'losslessly in the step; optional "disable_by_batch_size": N turns it off while more than N '
                   'sequences are running or waiting (default: off)')


def _lora_module(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {text!r}")
    return name, path


def _quantization_arg(g: "argparse._ActionsContainer") -> None:
    g.add_argument("--quantization", choices=("int8", "int4", "fp8"), default=None,
                   help="quantize the weights at load (weight-only: int8 per output channel, int4 in groups of "
                   "128 inputs, fp8 e4m3 per output channel) (default: none, the weights as the checkpoint stores them)")


def _size_args(g: argparse._ArgumentGroup) -> None:
    """The engine sizes `serve`, `generate` and `plan` share."""
    g.add_argument("--max-model-len", type=int, default=None, help="longest context (prompt + output) in "
                   "tokens (default: the model's max_position_embeddings, lowered to what the KV pool holds)")
    g.add_argument("--max-num-seqs", type=int, default=None, help="sequences that run at once (default: 256, "
                   "lowered to one per 256 tokens of KV pool)")
    g.add_argument("--max-num-batched-tokens", type=int, default=None, help="token budget of one step (default: "
                   "CPU 1024-2048 from the model's FLOPs per token, GPU 2048 or 8192 from 70 GiB, TPU 1024)")
    g.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    g.add_argument("--num-kv-pages", type=int, default=None, help="KV pool size in pages (default: from "
                   "--kv-cache-memory, else --memory-utilization)")
    g.add_argument("--kv-cache-memory", type=_size, default=None, help="bytes for the KV pool per device, e.g. "
                   "2GiB (default: from --memory-utilization)")
    g.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                   help="what KV pages store: auto (the compute dtype), or 8-bit values with a float32 scale per "
                   "token and KV head (int8; fp8 = fp8_e4m3; fp8_e5m2): ~2x the tokens of bf16 pages, ~4x of f32")
    g.add_argument("--memory-utilization", type=_fraction, default=None, help="share of device memory the "
                   "engine may use; the KV pool gets what weights and step temporaries leave (default: 0.9 on "
                   "GPU/TPU, 0.5 of the available RAM on CPU, where the pool is also capped at 2048 tokens "
                   "per sequence and 4 GiB)")
    g.add_argument("--token-buckets", type=_buckets, default=None,
                   help="declared step sizes in tokens, comma-separated, or 'auto' (default: auto = 16 x 4^k "
                   "below half the budget, then half the budget and the budget)")
    g.add_argument("--seq-buckets", type=_buckets, default=None,
                   help="declared sequence-count buckets, or 'auto' (default: auto = 4 x 4^k below half "
                   "--max-num-seqs, then half of it and --max-num-seqs)")


def _engine_config(args: argparse.Namespace, model_id: str) -> "EngineConfig":  # noqa: F821
    from jaxserve.config import EngineConfig

    mesh = args.mesh or (1, 1)
    if args.tensor_parallel_size is not None:
        if args.mesh is not None and args.mesh[1] != args.tensor_parallel_size:
            raise ValueError(f"--tensor-parallel-size {args.tensor_parallel_size} contradicts --mesh "
                             f"{args.mesh[0]}x{args.mesh[1]}")
        mesh = (mesh[0], args.tensor_parallel_size)
    return EngineConfig(
        model_id=model_id, **_size_fields(args), enable_prefix_caching=args.enable_prefix_caching, scheduling_policy=args.scheduling_policy,
        async_scheduling=args.async_scheduling,
        dtype=None if args.dtype == "auto" else args.dtype, quantization=args.quantization, load_format=args.load_format,
        mesh_shape=mesh, layout=args.layout,
        kv_offload_gib=args.kv_offload_gib, kv_role=args.kv_role,
        attention_backend=args.attention_backend, compilation_cache_dir=args.compilation_cache_dir, max_waiting_requests=args.max_waiting_requests,
        seed=args.seed, speculative_config=args.speculative_config, enable_lora=args.enable_lora,
        lora_modules=tuple(args.lora_modules), max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
        max_cpu_loras=args.max_cpu_loras)


def _size_fields(args: argparse.Namespace) -> dict:
    """EngineConfig fields from the flags of _size_args."""
    return dict(page_size=args.page_size, num_kv_pages=args.num_kv_pages, kv_cache_memory=args.kv_cache_memory,
                memory_utilization=args.memory_utilization, max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
                token_buckets=args.token_buckets, seq_buckets=args.seq_buckets, kv_cache_dtype=args.kv_cache_dtype)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends every flag's default to its help (scripts/bench_serving.py uses it too). A help text
    that already names its default is left as written: it explains a None default better than
    "None" does, and keeps a default read from the environment (--api-key) out of --help."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        if ("default" in help_text or action.default is argparse.SUPPRESS or action.required
                or not action.option_strings):
            return help_text
        shown = _show_default(action.default).replace("%", "%%")  # help texts are %-format strings
        return f"{help_text} (default: {shown})".lstrip()


def _show_default(value: object) -> str:
    """How a default reads in --help: (16, 64, 256) as 16,64,256; None and [] as none."""
    if value is None or value == []:
        return "none"
    if isinstance(value, (tuple, list)):
        return ",".join(str(v) for v in value)
    return str(value)


class _SubcommandParser(argparse.ArgumentParser):
    """A subcommand parser that rejects unknown flags itself, so the error shows the subcommand's
    usage (argparse would hand them up to the top-level parser, which prints `usage: jaxserve`)."""

    def parse_known_args(self, args: list[str] | None = None, namespace: argparse.Namespace | None = None
                         ) -> tuple[argparse.Namespace, list[str]]:
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace, extras


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxserve", description="JAX/XLA LLM serving engine",
                                     formatter_class=HelpFormatter)
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"),
                        help="logging level")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_SubcommandParser)

    def command(name: str, help_text: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help_text, description=help_text, formatter_class=HelpFormatter)

    s = command("serve", "run the OpenAI-compatible HTTP server")
    _engine_args(s)
    g = s.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on")
    g.add_argument("--port", type=int, default=8000, help="port to listen on")
    g.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) clients use in 'model' (default: --model, or jaxserve-tiny)")
    g.add_argument("--api-key", default=os.environ.get("JAXSERVE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $JAXSERVE_API_KEY)")
    g.add_argument("--request-timeout", type=_positive_float, default=None,
                   help="seconds per request (default: no limit)")
    g.add_argument("--max-request-bytes", type=_size, default=16 * 2**20, help="largest request body")
    g.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests may run after SIGTERM")
    g.add_argument("--access-log", action=argparse.BooleanOptionalAction, default=True,
                   help="log one line per HTTP request")
    g.add_argument("--no-progress", action="store_true", help="no progress bars")
    g.add_argument("--kv-transport", choices=("http", "jax"), default="http", help="how a --kv-role decode "
                   "instance fetches a prompt's pages: http (host-staged bytes over HTTP, every backend) or jax "
                   "(jax.experimental.transfer: device to device where the backend supports it; the prefill "
                   "instance offers them on a transfer server listening on its --host)")
    g.add_argument("--vllm-metric-names", action="store_true",
                   help="/metrics also exposes the queue, running and KV-cache gauges, cache_config_info and "
                   "lora_requests_info under vLLM's names, which gateway endpoint pickers (Gateway API Inference "
                   "Extension, GKE Inference Gateway, llm-d) read unconfigured")
    g.add_argument("--data-parallel-size", type=int, default=1, help="engine replicas on disjoint devices of this "
                   "host, one process each on PORT+1+i, behind a router on --port that balances by load and "
                   "prefix-cache affinity (docs/DEPLOY.md)")
    g.add_argument("--disaggregate", type=_prefill_decode, default=None, metavar="P:D", help="prefill/decode "
                   "disaggregation on this host in one command: P `--kv-role prefill` and D `--kv-role decode` "
                   "instances on disjoint devices, one process each on PORT+1.., behind `jaxserve proxy` on --port "
                   "(docs/DEPLOY.md) (default: off)")
    g = s.add_argument_group("multi-host (one model over the accelerators of several hosts; docs/DEPLOY.md)")
    g.add_argument("--num-hosts", type=int, default=1, help="processes that serve one model together, one per "
                   "host; every one runs this command with the same flags and its own --host-rank")
    g.add_argument("--host-rank", type=int, default=None, help="this process's rank; 0 serves HTTP, the others "
                   "follow its steps (default: auto-detected by JAX, e.g. on Cloud TPU VMs)")
    g.add_argument("--coordinator", default=None, metavar="HOST:PORT", help="rank 0's address for JAX's "
                   "distributed runtime (default: auto-detected); the step channel uses PORT+1")
    g.add_argument("--multihost-stall-timeout", type=_positive_float, default=DEFAULT_STALL_TIMEOUT, help="seconds without a "
                   "heartbeat after which a rank counts as dead and every other rank exits non-zero")
    g = s.add_argument_group("tools and reasoning")
    g.add_argument("--allow-runtime-lora-updating", action="store_true",
                   help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's endpoints; needs "
                   "--enable-lora)")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='parse tool calls out of the output when a request sends tools with tool_choice "auto"')
    g.add_argument("--tool-call-parser", default=None, help="tool-call format of the model: hermes (Qwen2.5, Qwen3, "
                   "Hermes); also the format forced calls (tool_choice required or named) are written in")
    g.add_argument("--reasoning-parser", default=None, help="split <think>...</think> into reasoning_content: "
                   "qwen3, deepseek_r1")

    gen = command("generate", "generate one completion and print it as it streams")
    _engine_args(gen)
    g = gen.add_argument_group("request")
    g.add_argument("--prompt", required=True, help="the prompt text")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template as a user turn")
    g.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    g.add_argument("--top-k", type=int, default=-1, help="sample from the k likeliest tokens; -1 = all")
    g.add_argument("--sampling-seed", type=int, default=None,
                   help="seed of this request (default: a random one)")
    g.add_argument("--stop", action="append", default=[], help="stop string; repeat for several")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating after an end-of-sequence token")
    g.add_argument("--no-progress", action="store_true", help="no progress bars")

    c = command("convert", "convert a HF checkpoint to an orbax checkpoint directory")
    c.add_argument("src", help="HF model directory or cached hub id")
    c.add_argument("dst", help="output directory")
    c.add_argument("--dtype", default=None, help="weight dtype to store (default: the checkpoint's dtype)")
    _quantization_arg(c)

    pl = command("plan", "will a model fit a TPU/GPU/CPU target, and how fast can it decode? Compiles the "
                 "serving programs for the target (no device needed) and reports memory, collectives and a "
                 "roofline estimate (docs/PLANNING.md)")
    pl.add_argument("model", help="HF model directory, cached hub id, or a config.json")
    g = pl.add_argument_group("target")
    g.add_argument("--target", required=True, help="tpu-v5e:2x4, tpu-v6e:2x2, tpu-v5p:2x2x1, gpu-h100:1x1x8, "
                   "gpu-h200:1x1x1, cpu, cpu:N (TPU: chip grid; GPU: slices x hosts x GPUs)")
    g.add_argument("--layout", default="tp", help="logical-axis rules (jaxserve/layouts.py RULE_SETS; not "
                   "tp-ep-data, which needs a data axis): tp "
                   "(serving's default), tp-ep (MoE: whole experts per device), tp-vocab-replicated or "
                   "tp-kv-replicated")
    g.add_argument("--tp", type=int, default=None, help="devices per replica (default: every device of the "
                   "target; the rest run data-parallel replicas)")
    g.add_argument("--dtype", default="auto", help="auto (float32 on cpu, else the checkpoint's), float32, "
                   "bfloat16, float16")
    _quantization_arg(g)
    g = pl.add_argument_group("engine")
    _size_args(g)
    g = pl.add_argument_group("report")
    g.add_argument("--context", type=int, default=None, help="tokens in cache per decoding sequence for the "
                   "step estimates (default: max_model_len)")
    g.add_argument("--batch", type=int, default=None, help="sequences per replica for --sweep's ranking "
                   "(default 64) and the reported collectives (default: max_num_seqs)")
    g.add_argument("--sweep", action="store_true", help="plan every layout that divides the model on the "
                   "target and rank them by decode tokens/s per chip")
    g.add_argument("--all-programs", action="store_true", help="compile every declared program, not only "
                   "the ones the figures need")
    g.add_argument("--compile-layers", type=int, default=None, help="compile a copy of the model this many "
                   "layers deep and scale what grows with depth (default: 2, the same figures much faster; every "
                   "layer with --all-programs)")
    g.add_argument("--json", default=None, help="write the plan as JSON to this file ('-': stdout, no table)")
    g.add_argument("--plot", default=None, help="write a PNG chart to this file (needs matplotlib)")

    r = command("router", "balance OpenAI requests over running jaxserve (or other OpenAI-compatible) servers by "
                "load and prefix-cache affinity; /metrics adds every replica's metrics, labelled")
    r.add_argument("--replicas", nargs="+", required=True, metavar="URL", help="the servers' base URLs, "
                   "e.g. http://10.0.0.5:8000")
    r.add_argument("--host", default="127.0.0.1", help="address to listen on")
    r.add_argument("--port", type=int, default=8000, help="port to listen on")
    r.add_argument("--balance-slack", type=int, default=8, help="requests by which the replica holding a "
                   "request's prefix may be busier than the least-loaded one (and 1.5x as busy) before load wins")

    x = command("proxy", "prefill/decode disaggregation behind one OpenAI API: each request is prefilled on a "
                "`serve --kv-role prefill` instance, then generated on a `serve --kv-role decode` instance that "
                "imports its KV pages")
    x.add_argument("--prefill", nargs="+", required=True, metavar="URL", help="prefill instances' base URLs")
    x.add_argument("--decode", nargs="+", required=True, metavar="URL", help="decode instances' base URLs")
    x.add_argument("--host", default="127.0.0.1", help="address to listen on")
    x.add_argument("--port", type=int, default=8000, help="port to listen on")

    # Only listed here for `jaxserve --help`: main() hands everything after `bench` to the script.
    b = command("bench", "load-test an OpenAI-compatible server (scripts/bench_serving.py; see "
                "`jaxserve bench --help`)")
    b.add_argument("bench_args", nargs=argparse.REMAINDER, help="arguments of scripts/bench_serving.py")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:  # everything after `bench` (--help included) belongs to bench_serving.py
        from jaxserve.server.commands import bench

        return bench(argv[1:])
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return _dispatch(args, argv)
    except (ValueError, FileNotFoundError, FileExistsError, ImportError) as e:
        # ImportError: a compiler plugin for a `plan` target is not installed (the message names the extra)
        print(f"jaxserve {args.command}: error: {e}", file=sys.stderr)
        return 2


def _dispatch(args: argparse.Namespace, argv: list[str]) -> int:
    if args.command == "router":
        import uvicorn

        from jaxserve.router.app import build_router

        uvicorn.run(build_router(args.replicas, args.balance_slack), host=args.host, port=args.port,
                    log_level=args.log_level, access_log=False)
        return 0
    if args.command == "proxy":
        import uvicorn

        from jaxserve.router.pd_proxy import build_pd_proxy

        uvicorn.run(build_pd_proxy(args.prefill, args.decode), host=args.host, port=args.port,
                    log_level=args.log_level, access_log=False)
        return 0
    if args.command == "serve" and args.disaggregate is not None:
        from jaxserve.router.replicas import serve_disaggregated

        if args.data_parallel_size != 1 or args.num_hosts != 1 or args.kv_role is not None:
            raise ValueError("--disaggregate starts its own prefill and decode instances: it does not combine with "
                             "--data-parallel-size, --num-hosts or --kv-role")
        data, model = _engine_config(args, "").mesh_shape
        if not args.enable_prefix_caching:
            raise ValueError("--disaggregate needs prefix caching (shipped pages are found by their prefix keys)")
        prefill, decode = args.disaggregate
        return serve_disaggregated(argv, prefill, decode, data * model, args.host, args.port, args.log_level)
    if args.command == "serve" and args.data_parallel_size != 1:
        from jaxserve.router.replicas import serve_data_parallel

        if args.data_parallel_size < 1:
            raise ValueError(f"--data-parallel-size must be >= 1, got {args.data_parallel_size}")
        if args.num_hosts != 1:
            raise ValueError("--data-parallel-size with --num-hosts is not supported: run a router "
                             "(`jaxserve router`) over multi-host servers instead")
        data, model = _engine_config(args, "").mesh_shape
        return serve_data_parallel(argv, args.data_parallel_size, data * model, args.host, args.port,
                                   args.log_level)
    if args.command == "serve":
        from jaxserve.server.launch import serve
        from jaxserve.server.state import ServerConfig

        names = tuple(args.served_model_name or [args.model or "jaxserve-tiny"])
        server_cfg = ServerConfig(served_model_names=names, api_key=args.api_key,
                                  max_waiting_requests=args.max_waiting_requests,
                                  request_timeout=args.request_timeout, max_request_bytes=args.max_request_bytes,
                                  reasoning_parser=args.reasoning_parser, tool_call_parser=args.tool_call_parser,
                                  enable_auto_tool_choice=args.enable_auto_tool_choice,
                                  allow_runtime_lora_updating=args.allow_runtime_lora_updating,
                                  vllm_metric_names=args.vllm_metric_names, kv_transport=args.kv_transport,
                                  kv_transfer_host=args.host)
        engine_cfg = _engine_config(args, names[0])
        multi = None
        if args.num_hosts != 1:
            from jaxserve import multihost

            multi = multihost.MultiHost(args.num_hosts, args.host_rank, args.coordinator,
                                        stall_timeout=args.multihost_stall_timeout)
            multihost.check_supported(engine_cfg)
            if multihost.initialize(multi) > 0:
                return multihost.run_follower(args.model, engine_cfg, multi)
        return serve(args.model, engine_cfg, server_cfg, args.host, args.port, args.shutdown_timeout,
                     args.log_level, args.access_log, not args.no_progress, multi)
    if args.command == "generate":
        from jaxserve.sampling_params import SamplingParams
        from jaxserve.server.commands import generate

        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                seed=args.sampling_seed, max_tokens=args.max_tokens, stop=args.stop,
                                ignore_eos=args.ignore_eos)
        generate(args.model, _engine_config(args, args.model or "jaxserve-tiny"), args.prompt, params,
                 chat=args.chat, show_progress=not args.no_progress)
        return 0
    if args.command == "plan":
        from jaxserve.config import EngineConfig
        from jaxserve.plan_report import run

        return run(args, EngineConfig(**_size_fields(args)))
    from jaxserve.server.commands import convert

    print(f"wrote {convert(args.src, args.dst, args.dtype, args.quantization)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
