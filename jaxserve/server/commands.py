"""The non-serving CLI commands: one-shot `generate`, checkpoint `convert`, and `bench`."""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import sys
import uuid
from pathlib import Path
from typing import TextIO

from jaxserve.core.config import EngineConfig, ModelConfig
from jaxserve.core.request import Request
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.text.tokenizer import Tokenizer

BENCH_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_serving.py"
# `generate`'s prefill bucket when the step budget is unset: longer prompts prefill in chunks of
# this many tokens, so one program serves every prompt length and the step's activations stay small.
MAX_GENERATE_PREFILL = 2048


def generate(model: str | None, engine_cfg: EngineConfig, prompt: str, params: SamplingParams, chat: bool = False,
             out: TextIO = sys.stdout, show_progress: bool = True) -> str:
    """Loads the model, generates one completion of `prompt` and prints its text as it streams.

    The engine runs `generate_engine_config(engine_cfg, ...)`: one request needs only a few of the
    programs a server declares. Returns the finish reason. Raises ValueError for invalid parameters
    or prompts."""
    from jaxserve.engine.async_engine import Engine
    from jaxserve.engine.loading import load_with_progress, model_dir_of
    from jaxserve.core.quiet import quiet_startup
    from jaxserve.server.streaming import RequestRun

    if params.n != 1:
        raise ValueError("generate prints one sample: n must be 1")
    # The prompt is tokenized before the model loads: its length sizes the compiled programs.
    quiet_startup()  # before the tokenizer imports transformers
    model_dir = model_dir_of(model)
    tokenizer = Tokenizer.from_pretrained(model_dir)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}]) if chat else tokenizer.encode(prompt)
    if not ids:
        raise ValueError("the prompt encodes to zero tokens")
    one_request_cfg = generate_engine_config(engine_cfg, len(ids), params.max_tokens,
                                             ModelConfig.from_hf(model_dir).max_position_embeddings)
    core, _, _ = load_with_progress(model, one_request_cfg, show_progress, tokenizer=tokenizer)

    async def run() -> str:
        engine = Engine(core)
        engine.start()
        try:
            request_run = RequestRun(engine, tokenizer, Request(uuid.uuid4().hex, ids, params,
                                                                tokenizer.eos_token_ids), 0)
            request_run.submit()
            reason = "abort"
            async for delta in request_run.deltas():
                out.write(delta.text)
                out.flush()
                reason = delta.finish_reason or reason
            out.write("\n")
            return reason
        finally:
            engine.shutdown()

    return asyncio.run(run())


def generate_engine_config(cfg: EngineConfig, prompt_len: int, max_tokens: int | None,
                           model_max_len: int) -> EngineConfig:
    """`cfg` cut down to one request of `prompt_len` prompt tokens and up to `max_tokens` more.

    Warm-up compiles every declared bucket, and a server's grid (many sequences, several step sizes,
    sampler history widths for a long context) costs far more than one request uses: here one
    sequence, a prefill bucket that holds the prompt (chunked above cfg's step budget) plus the
    decode bucket 1, a context of prompt + output and a KV pool of just that context. Sizes are
    rounded up to powers of two so that prompts of similar length compile the same programs (the
    persistent compilation cache then serves them). Unset (None) limits of cfg fall back to the
    model's context `model_max_len` and MAX_GENERATE_PREFILL. Raises ValueError, before anything
    loads, when the request cannot fit the context."""
    limit = min(cfg.max_model_len or model_max_len, model_max_len)
    context = limit if max_tokens is None else prompt_len + max_tokens
    if context > limit:
        raise ValueError(f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) = {context} exceeds "
                         f"the context limit {limit} (--max-model-len or the model's max_position_embeddings)")
    prefill = min(_power_of_two_at_least(prompt_len), cfg.max_num_batched_tokens or MAX_GENERATE_PREFILL)
    # with speculative decoding a decode carries up to k drafts: a bucket of 1 + k tokens too
    spec = cfg.speculative_config
    decodes = {1, 1 + spec.num_speculative_tokens} if spec is not None else {1}
    prefill = max(prefill, *decodes)
    max_model_len = min(_power_of_two_at_least(context), limit)
    return dataclasses.replace(cfg, max_num_seqs=1, seq_buckets=(1,), max_num_batched_tokens=prefill,
                               token_buckets=tuple(sorted({*decodes, prefill})), max_model_len=max_model_len,
                               num_kv_pages=-(-max_model_len // cfg.page_size))


def _power_of_two_at_least(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def convert(src: str, dst: str, dtype: str | None = None, quantization: str | None = None) -> Path:
    """HF safetensors (or a converted dir) at src -> orbax checkpoint + HF metadata at dst
    (quantized with an online scheme when `quantization` names one)."""
    import jax.numpy as jnp

    from checkpoints import load_model, orbax_io, resolve_model_dir
    from jaxserve.core.config import ModelConfig
    from jaxserve.engine.loading import resolve_dtype
    from jaxserve.parallel.sharding import make_mesh

    src_dir = resolve_model_dir(src)
    target = resolve_dtype(dtype, "float32") if dtype else jnp.dtype(ModelConfig.from_hf(src_dir).dtype)
    cfg, weights = load_model(src_dir, make_mesh(1, 1), target, quantization)
    return orbax_io.save(weights, dst, src_model_dir=src_dir, quantization=cfg.quantization)


def bench(argv: list[str]) -> int:
    """Runs scripts/bench_serving.py's main(argv) (scripts/ is not a package: loaded by path)."""
    if not BENCH_SCRIPT.is_file():
        print(f"jaxserve bench: {BENCH_SCRIPT} not found (bench needs a source checkout)", file=sys.stderr)
        return 2
    spec = importlib.util.spec_from_file_location("jaxserve_bench_serving", BENCH_SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses in the script look their module up there
    spec.loader.exec_module(module)
    return int(module.main(argv, prog="jaxserve bench") or 0)
