"""`jaxserve serve | generate | plan | convert | bench`: argparse -> EngineConfig / ServerConfig -> server/.

Engine sizes left unset (None) are chosen from the machine and the model when the engine starts
(jaxserve/core/capacity.py); an explicit flag always wins.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import logging
import os
import sys

from jaxserve.distributed.multihost import DEFAULT_STALL_TIMEOUT
from jaxserve.entrypoints.engine_args import (add_engine_args, add_lora_slot_args, add_quantization_arg, add_size_args,
    engine_config, lora_slot_fields, parse_size, positive_float, prefill_decode, size_fields)
from jaxserve.entrypoints.vllm_flags import add_vllm_flags, hint, log_notes


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
            self.error(f"unrecognized arguments: {' '.join(extras)}{hint(extras)}")
        return namespace, extras


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxserve", description="JAX/XLA LLM serving engine",
                                     formatter_class=HelpFormatter)
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"),
                        help="logging level")
    parser.add_argument("--version", action="version", version=f"jaxserve {importlib.metadata.version('jaxserve')}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_SubcommandParser)

    def command(name: str, help_text: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help_text, description=help_text, formatter_class=HelpFormatter)

    s = command("serve", "run the OpenAI-compatible HTTP server")
    s.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="the model, as `vllm serve MODEL` takes it (the same as --model)")
    add_engine_args(s)
    g = s.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on")
    g.add_argument("--port", type=int, default=8000, help="port to listen on")
    g.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) clients use in 'model' (default: --model, or jaxserve-tiny)")
    g.add_argument("--api-key", default=os.environ.get("JAXSERVE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $JAXSERVE_API_KEY)")
    g.add_argument("--request-timeout", type=positive_float, default=None,
                   help="seconds per request (default: no limit)")
    g.add_argument("--max-request-bytes", type=parse_size, default=16 * 2**20, help="largest request body")
    g.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests may still run after SIGTERM or Ctrl+C (both), after which "
                   "they end with finish_reason \"abort\"; a second Ctrl+C stops at once")
    g.add_argument("--access-log", action=argparse.BooleanOptionalAction, default=True,
                   help="log one line per HTTP request")
    g.add_argument("--no-progress", action="store_true", help="no progress bars")
    g.add_argument("--uvicorn-log-level", default=None, choices=("critical", "error", "warning", "info", "debug",
                   "trace"), help="the HTTP server's log level (default: jaxserve's --log-level)")
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
    g.add_argument("--disaggregate", type=prefill_decode, default=None, metavar="P:D", help="prefill/decode "
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
    g.add_argument("--multihost-stall-timeout", type=positive_float, default=DEFAULT_STALL_TIMEOUT, help="seconds without a "
                   "heartbeat after which a rank counts as dead and every other rank exits non-zero")
    g = s.add_argument_group("tools and reasoning")
    g.add_argument("--allow-runtime-lora-updating", action="store_true",
                   help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's endpoints; needs "
                   "--enable-lora)")
    g.add_argument("--enable-response-store", action="store_true", help="/v1/responses keeps responses (store: "
                   "true, OpenAI's default) in memory, bounded in count and bytes, for GET /v1/responses/{id} and "
                   "previous_response_id (default: off; then those get a 400 and an omitted store means false)")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='parse tool calls out of the output when a request sends tools with tool_choice "auto"')
    g.add_argument("--tool-call-parser", default=None, help="tool-call format of the model: hermes (Qwen2.5, Qwen3, "
                   "Hermes); also the format forced calls (tool_choice required or named) are written in")
    g.add_argument("--chat-template", default=None, help="a Jinja chat template, or a file holding one, used "
                   "instead of the model's own (default: the model's tokenizer_config.json)")
    g.add_argument("--generation-config", default="auto", metavar="auto|vllm|DIR", help="the sampling defaults of "
                   "requests that leave temperature, top_p, top_k, min_p or repetition_penalty out: auto (the "
                   "model's generation_config.json, as vLLM does), vllm (OpenAI's: temperature 1, no truncation), or "
                   "a directory holding a generation_config.json (default: auto)")
    g.add_argument("--reasoning-parser", default=None, help="split <think>...</think> into reasoning_content: "
                   "qwen3, deepseek_r1")
    add_vllm_flags(s)

    gen = command("generate", "generate one completion and print it as it streams")
    add_engine_args(gen, serving=False)
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
    add_quantization_arg(c)

    pl = command("plan", "will a model fit a TPU/GPU/CPU target, and how fast can it decode? Compiles the "
                 "serving programs for the target (no device needed) and reports memory, collectives and a "
                 "roofline estimate (docs/PLANNING.md)")
    pl.add_argument("model", help="HF model directory, cached hub id, or a config.json")
    g = pl.add_argument_group("target")
    g.add_argument("--target", required=True, help="tpu-v5e:2x4, tpu-v6e:2x2, tpu-v5p:2x2x1, gpu-h100:1x1x8, "
                   "gpu-h200:1x1x1, cpu, cpu:N (TPU: chip grid; GPU: slices x hosts x GPUs)")
    g.add_argument("--layout", default="tp", help="logical-axis rules (jaxserve/parallel/layouts.py RULE_SETS; not "
                   "tp-ep-data, which needs a data axis): tp "
                   "(serving's default), tp-ep (MoE: whole experts per device), tp-vocab-replicated or "
                   "tp-kv-replicated")
    g.add_argument("--tp", type=int, default=None, help="devices per replica (default: every device of the "
                   "target; the rest run data-parallel replicas)")
    g.add_argument("--dtype", default="auto", help="auto (float32 on cpu, else the checkpoint's), float32, "
                   "bfloat16, float16")
    add_quantization_arg(g)
    g = pl.add_argument_group("engine")
    add_size_args(g)
    add_lora_slot_args(g)
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
    log_notes(args)
    try:
        return _dispatch(args, argv)
    except (ValueError, FileNotFoundError, FileExistsError, ImportError) as e:
        # ImportError: a compiler plugin for a `plan` target is not installed (the message names the extra)
        print(f"jaxserve {args.command}: error: {e}", file=sys.stderr)
        return 2


def _dispatch(args: argparse.Namespace, argv: list[str]) -> int:
    if getattr(args, "model_tag", None) is not None:
        if args.model is not None and args.model != args.model_tag:
            raise ValueError(f"two models named: {args.model_tag} (positional) and --model {args.model}")
        args.model = args.model_tag
    if args.command == "router":
        import uvicorn

        from jaxserve.distributed.router import build_router

        uvicorn.run(build_router(args.replicas, args.balance_slack), host=args.host, port=args.port,
                    log_level=args.log_level, access_log=False, log_config=None)  # our format (launch.py)
        return 0
    if args.command == "proxy":
        import uvicorn

        from jaxserve.disagg.pd_proxy import build_pd_proxy

        uvicorn.run(build_pd_proxy(args.prefill, args.decode), host=args.host, port=args.port,
                    log_level=args.log_level, access_log=False, log_config=None)
        return 0
    if args.command == "serve" and args.disaggregate is not None:
        from jaxserve.disagg.pd_proxy import serve_disaggregated

        if args.data_parallel_size != 1 or args.num_hosts != 1 or args.kv_role is not None:
            raise ValueError("--disaggregate starts its own prefill and decode instances: it does not combine with "
                             "--data-parallel-size, --num-hosts or --kv-role")
        data, model = engine_config(args, "").mesh_shape
        if not args.enable_prefix_caching:
            raise ValueError("--disaggregate needs prefix caching (shipped pages are found by their prefix keys)")
        prefill, decode = args.disaggregate
        return serve_disaggregated(argv, prefill, decode, data * model, args.host, args.port, args.log_level)
    if args.command == "serve" and args.data_parallel_size != 1:
        from jaxserve.distributed.replicas import serve_data_parallel

        if args.data_parallel_size < 1:
            raise ValueError(f"--data-parallel-size must be >= 1, got {args.data_parallel_size}")
        if args.num_hosts != 1:
            raise ValueError("--data-parallel-size with --num-hosts is not supported: run a router "
                             "(`jaxserve router`) over multi-host servers instead")
        data, model = engine_config(args, "").mesh_shape
        return serve_data_parallel(argv, args.data_parallel_size, data * model, args.host, args.port,
                                   args.log_level)
    if args.command == "serve":
        from jaxserve.server.launch import serve
        from jaxserve.server.state import ServerConfig
        from jaxserve.text.generation_config import check_choice
        from jaxserve.text.tokenizer import read_chat_template

        names = tuple(args.served_model_name or [args.model or "jaxserve-tiny"])
        server_cfg = ServerConfig(served_model_names=names, api_key=args.api_key,
                                  max_waiting_requests=args.max_waiting_requests,
                                  request_timeout=args.request_timeout, max_request_bytes=args.max_request_bytes,
                                  reasoning_parser=args.reasoning_parser, tool_call_parser=args.tool_call_parser,
                                  enable_auto_tool_choice=args.enable_auto_tool_choice,
                                  allow_runtime_lora_updating=args.allow_runtime_lora_updating,
                                  vllm_metric_names=args.vllm_metric_names, kv_transport=args.kv_transport,
                                  kv_transfer_host=args.host,
                                  chat_template=args.chat_template and read_chat_template(args.chat_template),
                                  generation_config=check_choice(args.generation_config),
                                  enable_response_store=args.enable_response_store)
        engine_cfg = engine_config(args, names[0])
        multi = None
        if args.num_hosts != 1:
            from jaxserve.distributed import multihost

            multi = multihost.MultiHost(args.num_hosts, args.host_rank, args.coordinator,
                                        stall_timeout=args.multihost_stall_timeout)
            multihost.check_supported(engine_cfg)
            if multihost.initialize(multi) > 0:
                return multihost.run_follower(args.model, engine_cfg, multi)
        return serve(args.model, engine_cfg, server_cfg, args.host, args.port, args.shutdown_timeout,
                     args.uvicorn_log_level or args.log_level, args.access_log, not args.no_progress, multi)
    if args.command == "generate":
        from jaxserve.core.sampling_params import SamplingParams
        from jaxserve.server.commands import generate

        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                seed=args.sampling_seed, max_tokens=args.max_tokens, stop=args.stop,
                                ignore_eos=args.ignore_eos)
        generate(args.model, engine_config(args, args.model or "jaxserve-tiny"), args.prompt, params,
                 chat=args.chat, show_progress=not args.no_progress)
        return 0
    if args.command == "plan":
        from jaxserve.core.config import EngineConfig
        from jaxserve.planning.report import run

        return run(args, EngineConfig(**size_fields(args), **lora_slot_fields(args)))
    from jaxserve.server.commands import convert

    print(f"wrote {convert(args.src, args.dst, args.dtype, args.quantization)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
