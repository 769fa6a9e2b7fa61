"""The non-serving CLI commands: one-shot `generate`, checkpoint `convert`, and `bench`."""

from __future__ import annotations

import asyncio
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


def generate(model: str | None, engine_cfg: EngineConfig, prompt: str, params: SamplingParams, chat: bool = False,
             out: TextIO = sys.stdout, show_progress: bool = True) -> str:
    """Loads the model, generates one completion of `prompt` and prints its text as it streams.

    The engine is the one `serve` would run with the same flags, so the two share compiled programs
    (with the default background warm-up the request starts on the smallest step shape while the
    others compile). Returns the finish reason. Raises ValueError for invalid parameters
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
    check_request_fits(engine_cfg, len(ids), params.max_tokens, ModelConfig.from_hf(model_dir).max_position_embeddings)
    core, _, _ = load_with_progress(model, engine_cfg, show_progress, tokenizer=tokenizer)

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


def check_request_fits(cfg: EngineConfig, prompt_len: int, max_tokens: int | None, model_max_len: int) -> None:
    """Raises ValueError, before anything loads, when one request of `prompt_len` prompt tokens and
    up to `max_tokens` more cannot fit the context (--max-model-len, else the model's)."""
    limit = min(cfg.max_model_len or model_max_len, model_max_len)
    if max_tokens is not None and prompt_len + max_tokens > limit:
        raise ValueError(f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) = {prompt_len + max_tokens} "
                         f"exceeds the context limit {limit} (--max-model-len or the model's max_position_embeddings)")


def convert(src: str, dst: str, dtype: str | None = None, quantization: str | None = None) -> Path:
    """HF safetensors (or a converted dir) at src -> orbax checkpoint + HF metadata at dst
    (quantized with an online scheme when `quantization` names one)."""
    from jaxserve.core.quiet import quiet_startup

    quiet_startup()  # before jax picks its backend; orbax's INFO lines while it saves
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
