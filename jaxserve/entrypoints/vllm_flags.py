"""vLLM's serving flags, as someone who types them from habit meets them here.

Three kinds: flags whose meaning jaxserve has under another name are aliases on the jaxserve flag
itself (engine_args.py, e.g. --gpu-memory-utilization); flags that ask for what jaxserve always does
(or never needs) are accepted and say so once at start-up (`NOTED`); flags that ask for what jaxserve
will not do are refused with the reason (`REFUSED`). Any other unknown flag that vLLM knows gets a
hint naming jaxserve's way to the same end (`HINTS`), in the usage error.
"""

from __future__ import annotations

import argparse
import logging

logger = logging.getLogger("jaxserve.entrypoints.vllm_flags")

NOTED = {
    "--enable-chunked-prefill": "chunked prefill is always on in jaxserve: a long prompt is split over steps of at "
                                "most --max-num-batched-tokens tokens, beside the decoding sequences",
    "--enforce-eager": "jaxserve has no eager mode to force: every step runs an XLA program compiled before it is "
                       "needed (never on a request's path); --warmup full compiles them all before serving",
    "--disable-log-requests": "jaxserve never logs requests' contents; --no-access-log drops the one line per HTTP "
                              "request",
}

REFUSED = {
    "--trust-remote-code": "jaxserve runs no code from a checkpoint: its model families are its own JAX code, "
                           "chosen by config.json's architectures (the README lists them); a model that needs "
                           "remote code is not one of them",
}

HINTS = {
    "--pipeline-parallel-size": "jaxserve splits a model over devices by tensor parallelism: --tensor-parallel-size "
                                "N or --mesh DATAxMODEL, and --num-hosts for several hosts",
    "--num-gpu-blocks-override": "use --num-kv-pages (KV pages of --page-size tokens)",
    "--kv-cache-memory-bytes": "use --kv-cache-memory (e.g. 2GiB)",
    "--cpu-offload-gb": "jaxserve keeps the weights on the devices; --kv-offload-gib N adds a host-memory KV tier",
    "--tokenizer": "the tokenizer is read from --model's directory (tokenizer.json)",
    "--download-dir": "jaxserve reads the Hugging Face cache: set HF_HOME",
    "--device": "set JAX_PLATFORMS (cpu, cuda, tpu) to pick the devices",
    "--disable-uvicorn-access-log": "use --no-access-log",
    "--compilation-config": "the step shapes compiled are --token-buckets and --seq-buckets; --warmup picks when",
    "--cuda-graph-sizes": "the step shapes compiled are --token-buckets and --seq-buckets",
    "--max-seq-len-to-capture": "the step shapes compiled are --token-buckets and --seq-buckets",
    "--distributed-executor-backend": "several hosts serve one model with --num-hosts (docs/DEPLOY.md)",
}


class _Switch(argparse.Action):
    """A flag that takes no value (vLLM's store_true flags)."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: object) -> None:
        super().__init__(option_strings, dest, nargs=0, **kwargs)


class Noted(_Switch):
    """A vLLM flag accepted for what jaxserve always does: noted once, changes nothing."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:
        notes = list(getattr(namespace, self.dest, None) or [])
        notes.append(f"{option_string}: {NOTED[option_string]}")
        setattr(namespace, self.dest, notes)


class Refused(_Switch):
    """A vLLM flag jaxserve will not honour: a usage error that says why."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:
        parser.error(f"{option_string} is not supported: {REFUSED[option_string]}")


def add_vllm_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("vLLM's flags (accepted so that a vLLM command line runs; each says what it does here)")
    for flag, what in NOTED.items():
        g.add_argument(flag, action=Noted, dest="vllm_notes", default=[], help=f"{what}; accepted, changes nothing (default: off)")
    for flag, why in REFUSED.items():
        g.add_argument(flag, action=Refused, default=argparse.SUPPRESS, help=f"refused: {why} (default: off)")


def log_notes(args: argparse.Namespace) -> None:
    for note in getattr(args, "vllm_notes", None) or []:
        logger.info("%s", note)


def hint(unknown: list[str]) -> str:
    """'' or, for each unknown flag vLLM knows, a line naming jaxserve's way to the same end."""
    lines = []
    for arg in unknown:
        flag = arg.split("=", 1)[0]
        if flag in HINTS:
            lines.append(f"  {flag} is vLLM's: {HINTS[flag]}")
    return ("\n" + "\n".join(lines)) if lines else ""
