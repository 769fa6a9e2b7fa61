"""The engine's command-line flags (shared by serve, generate and plan), their value parsers with
errors that name the flag's expected form, and the EngineConfig they build."""

from __future__ import annotations

import argparse
import re

from jaxserve.core.config import LOAD_FORMATS
from jaxserve.quant.kv import KV_CACHE_DTYPES

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)


_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


def parse_size(text: str) -> int:
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
    from jaxserve.parallel.sharding import parse_mesh
    try:
        return parse_mesh(text.strip())
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def prefill_decode(text: str) -> tuple[int, int]:
    """P:D, the prefill and decode instances of --disaggregate."""
    try:
        prefill, decode = (int(n) for n in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected P:D (e.g. 1:1), got {text!r}") from None
    if prefill < 1 or decode < 1:
        raise argparse.ArgumentTypeError(f"needs at least one prefill and one decode instance, got {text!r}")
    return prefill, decode


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def add_engine_args(p: argparse.ArgumentParser, serving: bool = True) -> None:
    """The engine's flags; serving=False (`generate`, one request) leaves out the flags that only a
    server's many requests use, their defaults still set, so the engine is configured as serve's is."""
    g = p.add_argument_group("engine")
    # the flags only a server uses; for `generate` declared on a scratch parser for their defaults
    many = g if serving else argparse.ArgumentParser(add_help=False)
    g.add_argument("--model", default=None, help="HF model directory or cached hub id (default: the embedded "
                   "jaxserve-tiny model, random weights)")
    add_size_args(g)
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="share KV pages of identical prompt prefixes between requests")
    many.add_argument("--kv-role", choices=("prefill", "decode"), default=None, help="prefill/decode "
                      "disaggregation: a prefill instance exports its prompts' KV pages (POST /v1/kv/export); a decode "
                      "instance imports them for requests that name it in kv_transfer_params (`jaxserve proxy` does "
                      "both) (default: neither)")
    many.add_argument("--kv-offload-gib", "--swap-space", type=positive_float, default=None, help="a host-memory KV tier of this "
                      "many GiB: cached pages evicted from the device move there and come back on a prefix hit, and a "
                      "preempted sequence's pages come back instead of being recomputed; needs prefix caching; "
                      "--swap-space is vLLM's name (default: off)")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                   help="plan and dispatch step n+1 before step n's tokens are fetched")
    g.add_argument("--tensor-parallel-size", type=int, default=None, help="shorthand for --mesh 1xN "
                   "(default: from --mesh)")
    g.add_argument("--mesh", type=_mesh, default=None, help="device mesh DATAxMODEL (default: 1x1)")
    g.add_argument("--layout", default="tp", help="how the mesh splits the model (jaxserve/parallel/layouts.py): tp, "
                   "tp-ep (MoE: whole experts over the model axis, tokens dispatched to them by all-to-all), "
                   "tp-ep-data (MoE, EP x TP: experts over the data axis, each expert's width over the model "
                   "axis), tp-vocab-replicated, tp-kv-replicated")
    g.add_argument("--dtype", default="auto", help="auto (float32 on CPU, else the checkpoint's), float32, "
                   "bfloat16, float16")
    add_quantization_arg(g)
    g.add_argument("--load-format", choices=LOAD_FORMATS, default="auto", help="auto: read the checkpoint's "
                   "weights; dummy: random weights drawn on the devices from config.json alone (benchmarks at a "
                   "model's shape without its weights: only config.json and the tokenizer are read)")
    many.add_argument("--scheduling-policy", choices=("fcfs", "priority"), default="fcfs",
                      help="waiting order: arrival, or the request's priority (lower first) then arrival")
    g.add_argument("--attention-backend", choices=("auto", "reference", "tiled", "cpu", "tpu", "gpu"), default="auto",
                   help="attention implementation; auto picks the platform's kernel (on CPU: 'cpu', the tiled jnp "
                        "path with a native decode kernel built at first use, or 'tiled' where no compiler is)")
    g.add_argument("--warmup", choices=("background", "full"), default="background",
                   help="background: serve as soon as the smallest step shape is compiled and compile the others "
                   "on a thread, steps taking the shapes ready meanwhile (never a compile on the request path); full: "
                   "compile every program before /health says ready")
    g.add_argument("--compilation-cache-dir", default=None, help="persistent XLA compilation cache directory; "
                   "'' turns it off (default: $XDG_CACHE_HOME or ~/.cache, then jaxserve/xla)")
    many.add_argument("--max-waiting-requests", type=int, default=1024,
                      help="queued sequences beyond which new requests get 429")
    g.add_argument("--seed", type=int, default=0, help="seeds the random seeds of requests that bring none")
    add_lora_slot_args(many)
    many.add_argument("--lora-modules", nargs="+", type=_lora_module, default=[], metavar="NAME=PATH",
                      help="PEFT adapters (directories with adapter_config.json + adapter_model.safetensors, or hub "
                      "ids in the local Hugging Face cache) loaded at start-up; a request selects one by its model field")
    many.add_argument("--max-cpu-loras", type=int, default=None, help="adapters kept in host memory, least recently "
                      "used evicted (re-read from disk when a slot needs them) (default: --max-loras)")
    g.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, vLLM\'s JSON shape, e.g. \'{"method": "ngram", '
                   '"num_speculative_tokens": 4, "prompt_lookup_max": 4}\' (prompt lookup: drafts copied from '
                   'the sequence\'s own earlier tokens) or \'{"method": "draft_model", "model": DIR, '
                   '"num_speculative_tokens": 4}\' (a smaller model with the same tokenizer proposes) or '
                   '\'{"method": "eagle3", "model": DIR, "num_speculative_tokens": 4}\' (an EAGLE-3 head trained '
                   'for the model, in the Hugging Face layout, reads its hidden states) or \'{"method": "mtp", '
                   '"num_speculative_tokens": 2}\' (the multi-token-prediction layer a DeepSeek-V3 or GLM-4.5 '
                   'checkpoint ships); drafts are verified '
                   'losslessly in the step; optional "disable_by_batch_size": N turns it off while more than N '
                   'sequences are running or waiting (default: off)')
    if not serving:
        p.set_defaults(**vars(many.parse_args([])))


def _lora_module(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {text!r}")
    return name, path


def add_quantization_arg(g: "argparse._ActionsContainer") -> None:
    g.add_argument("--quantization", choices=("int8", "int4", "fp8"), default=None,
                   help="quantize the weights at load (weight-only: int8 per output channel, int4 in groups of "
                   "128 inputs, fp8 e4m3 per output channel) (default: none, the weights as the checkpoint stores them)")


def add_size_args(g: argparse._ArgumentGroup) -> None:
    """The engine sizes `serve`, `generate` and `plan` share."""
    g.add_argument("--max-model-len", type=int, default=None, help="longest context (prompt + output) in "
                   "tokens (default: the model's max_position_embeddings, lowered to what the KV pool holds)")
    g.add_argument("--max-num-seqs", type=int, default=None, help="sequences that run at once (default: 256, "
                   "lowered to one per 256 tokens of KV pool)")
    g.add_argument("--max-num-batched-tokens", type=int, default=None, help="token budget of one step (default: "
                   "CPU 1024-2048 from the model's FLOPs per token, GPU 2048 or 8192 from 70 GiB, TPU 1024)")
    g.add_argument("--page-size", "--block-size", type=int, default=16, help="tokens per KV page "
                   "(--block-size: vLLM's name)")
    g.add_argument("--num-kv-pages", type=int, default=None, help="KV pool size in pages (default: from "
                   "--kv-cache-memory, else --memory-utilization)")
    g.add_argument("--kv-cache-memory", type=parse_size, default=None, help="bytes for the KV pool per device, e.g. "
                   "2GiB (default: from --memory-utilization)")
    g.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                   help="what KV pages store: auto (the compute dtype), or 8-bit values with a float32 scale per "
                   "token and KV head (int8; fp8 = fp8_e4m3; fp8_e5m2): ~2x the tokens of bf16 pages, ~4x of f32")
    g.add_argument("--memory-utilization", "--gpu-memory-utilization", type=_fraction, default=None, help="share of device memory the "
                   "engine may use; the KV pool gets what weights and step temporaries leave (default: 0.9 on "
                   "GPU/TPU, 0.5 of the available RAM on CPU, where the pool is also capped at "
                   "max_num_seqs x 2048 tokens (a total) and 4 GiB; --gpu-memory-utilization: vLLM's name, on every platform)")
    g.add_argument("--token-buckets", type=_buckets, default=None,
                   help="declared step sizes in tokens, comma-separated, or 'auto' (default: auto = 16 x 4^k "
                   "below half the budget, then half the budget and the budget)")
    g.add_argument("--seq-buckets", type=_buckets, default=None,
                   help="declared sequence-count buckets, or 'auto' (default: auto = 4 x 4^k below half "
                   "--max-num-seqs, then half of it and --max-num-seqs)")


def engine_config(args: argparse.Namespace, model_id: str) -> "EngineConfig":  # noqa: F821
    from jaxserve.core.config import EngineConfig

    mesh = args.mesh or (1, 1)
    if args.tensor_parallel_size is not None:
        if args.mesh is not None and args.mesh[1] != args.tensor_parallel_size:
            raise ValueError(f"--tensor-parallel-size {args.tensor_parallel_size} contradicts --mesh "
                             f"{args.mesh[0]}x{args.mesh[1]}")
        mesh = (mesh[0], args.tensor_parallel_size)
    return EngineConfig(
        model_id=model_id, **size_fields(args), enable_prefix_caching=args.enable_prefix_caching, scheduling_policy=args.scheduling_policy,
        async_scheduling=args.async_scheduling,
        dtype=None if args.dtype == "auto" else args.dtype, quantization=args.quantization, load_format=args.load_format,
        mesh_shape=mesh, layout=args.layout,
        kv_offload_gib=args.kv_offload_gib, kv_role=args.kv_role,
        attention_backend=args.attention_backend, compilation_cache_dir=args.compilation_cache_dir, max_waiting_requests=args.max_waiting_requests,
        seed=args.seed, speculative_config=args.speculative_config, **lora_slot_fields(args),
        lora_modules=tuple(args.lora_modules),
        max_cpu_loras=args.max_cpu_loras, warmup=args.warmup)


def add_lora_slot_args(g: argparse._ArgumentGroup) -> None:
    """The flags that size the LoRA slots (serving and `plan` count their device memory alike)."""
    g.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters on the base model")
    g.add_argument("--max-loras", type=int, default=4, help="adapter slots on the device")
    g.add_argument("--max-lora-rank", type=int, default=16, help="largest adapter rank (every slot is this wide)")


def lora_slot_fields(args: argparse.Namespace) -> dict:
    """EngineConfig fields from the flags of add_lora_slot_args."""
    return dict(enable_lora=args.enable_lora, max_loras=args.max_loras, max_lora_rank=args.max_lora_rank)


def size_fields(args: argparse.Namespace) -> dict:
    """EngineConfig fields from the flags of add_size_args."""
    return dict(page_size=args.page_size, num_kv_pages=args.num_kv_pages, kv_cache_memory=args.kv_cache_memory,
                memory_utilization=args.memory_utilization, max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
                token_buckets=args.token_buckets, seq_buckets=args.seq_buckets, kv_cache_dtype=args.kv_cache_dtype)
