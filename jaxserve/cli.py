"""`jaxserve serve | generate | convert | bench`: argparse -> EngineConfig / ServerConfig -> server/.

Defaults are CPU-friendly (the embedded model starts in well under a minute on 2 cores): few
declared buckets, a 2048-token context, 16 sequences, 256 tokens per step. Raise them on an
accelerator (e.g. `--max-num-seqs 128 --max-num-batched-tokens 2048 --token-buckets auto`).
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys

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


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None, help="HF model directory or cached hub id (default: the embedded "
                   "jaxserve-tiny model, random weights)")
    g.add_argument("--max-model-len", type=int, default=2048)
    g.add_argument("--max-num-seqs", type=int, default=16)
    g.add_argument("--max-num-batched-tokens", type=int, default=256)
    g.add_argument("--page-size", type=int, default=16)
    g.add_argument("--num-kv-pages", type=int, default=None, help="KV pool size in pages (default: from "
                   "--kv-cache-memory)")
    g.add_argument("--kv-cache-memory", type=_size, default=256 * 2**20, help="bytes for the KV pool, e.g. 2GiB")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                   help="plan and dispatch step n+1 before step n's tokens are fetched")
    g.add_argument("--tensor-parallel-size", type=int, default=None, help="shorthand for --mesh 1xN")
    g.add_argument("--mesh", type=_mesh, default=None, help="device mesh DATAxMODEL (default 1x1)")
    g.add_argument("--dtype", default="auto", help="auto (float32 on CPU, else the checkpoint's), float32, "
                   "bfloat16, float16")
    g.add_argument("--scheduling-policy", choices=("fcfs", "priority"), default="fcfs")
    g.add_argument("--token-buckets", type=_buckets, default=(16, 64, 256),
                   help="declared step sizes in tokens, comma-separated, or 'auto' (powers of two)")
    g.add_argument("--seq-buckets", type=_buckets, default=None,
                   help="declared sequence-count buckets, or 'auto' (default: just --max-num-seqs)")
    g.add_argument("--attention-backend", choices=("auto", "reference", "tpu", "gpu"), default="auto")
    g.add_argument("--compilation-cache-dir", default=None, help="persistent XLA compilation cache")
    g.add_argument("--max-waiting-requests", type=int, default=1024)
    g.add_argument("--seed", type=int, default=0)


def _engine_config(args: argparse.Namespace, model_id: str) -> "EngineConfig":  # noqa: F821
    from jaxserve.config import EngineConfig

    mesh = args.mesh or (1, 1)
    if args.tensor_parallel_size is not None:
        if args.mesh is not None and args.mesh[1] != args.tensor_parallel_size:
            raise ValueError(f"--tensor-parallel-size {args.tensor_parallel_size} contradicts --mesh "
                             f"{args.mesh[0]}x{args.mesh[1]}")
        mesh = (mesh[0], args.tensor_parallel_size)
    token_buckets = args.token_buckets
    if token_buckets is not None:  # keep only buckets the step budget can use, and always the budget
        token_buckets = tuple(sorted({b for b in token_buckets if b < args.max_num_batched_tokens}
                                     | {args.max_num_batched_tokens}))
    seq_buckets = args.seq_buckets if args.seq_buckets is not None else (args.max_num_seqs,)
    return EngineConfig(
        model_id=model_id, page_size=args.page_size, num_kv_pages=args.num_kv_pages,
        kv_cache_memory=args.kv_cache_memory, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
        enable_prefix_caching=args.enable_prefix_caching, scheduling_policy=args.scheduling_policy,
        async_scheduling=args.async_scheduling,
        dtype=None if args.dtype == "auto" else args.dtype, mesh_shape=mesh,
        attention_backend=args.attention_backend, token_buckets=token_buckets, seq_buckets=seq_buckets,
        compilation_cache_dir=args.compilation_cache_dir, max_waiting_requests=args.max_waiting_requests,
        seed=args.seed)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxserve", description="JAX/XLA LLM serving engine")
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    sub = parser.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    _engine_args(s)
    g = s.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) clients use in 'model' (default: --model, or jaxserve-tiny)")
    g.add_argument("--api-key", default=os.environ.get("JAXSERVE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $JAXSERVE_API_KEY)")
    g.add_argument("--request-timeout", type=_positive_float, default=None, help="seconds per request")
    g.add_argument("--max-request-bytes", type=_size, default=16 * 2**20)
    g.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests may run after SIGTERM")
    g.add_argument("--access-log", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--no-progress", action="store_true", help="no progress bars")

    gen = sub.add_parser("generate", help="generate one completion and print it as it streams")
    _engine_args(gen)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template as a user turn")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--sampling-seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[])
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--no-progress", action="store_true")

    c = sub.add_parser("convert", help="convert a HF checkpoint to an orbax checkpoint directory")
    c.add_argument("src")
    c.add_argument("dst")
    c.add_argument("--dtype", default=None, help="default: the checkpoint's dtype")

    b = sub.add_parser("bench", help="run scripts/bench_serving.py against a server (args passed through)")
    b.add_argument("bench_args", nargs=argparse.REMAINDER)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:  # everything after `bench` (--help included) belongs to bench_serving.py
        from jaxserve.server.commands import bench

        return bench(argv[1:])
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return _dispatch(args)
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        print(f"jaxserve {args.command}: error: {e}", file=sys.stderr)
        return 2


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "serve":
        from jaxserve.server.launch import serve
        from jaxserve.server.state import ServerConfig

        names = tuple(args.served_model_name or [args.model or "jaxserve-tiny"])
        server_cfg = ServerConfig(served_model_names=names, api_key=args.api_key,
                                  max_waiting_requests=args.max_waiting_requests,
                                  request_timeout=args.request_timeout, max_request_bytes=args.max_request_bytes)
        return serve(args.model, _engine_config(args, names[0]), server_cfg, args.host, args.port,
                     args.shutdown_timeout, args.log_level, args.access_log, not args.no_progress)
    if args.command == "generate":
        from jaxserve.sampling_params import SamplingParams
        from jaxserve.server.commands import generate

        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                seed=args.sampling_seed, max_tokens=args.max_tokens, stop=args.stop,
                                ignore_eos=args.ignore_eos)
        generate(args.model, _engine_config(args, args.model or "jaxserve-tiny"), args.prompt, params,
                 chat=args.chat, show_progress=not args.no_progress)
        return 0
    from jaxserve.server.commands import convert

    print(f"wrote {convert(args.src, args.dst, args.dtype)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
