"""The non-serving CLI commands: one-shot `generate`, checkpoint `convert`, and `bench`."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
import uuid
from pathlib import Path
from typing import TextIO

from jaxserve.config import EngineConfig
from jaxserve.request import Request
from jaxserve.sampling_params import SamplingParams

BENCH_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_serving.py"


def generate(model: str | None, engine_cfg: EngineConfig, prompt: str, params: SamplingParams, chat: bool = False,
             out: TextIO = sys.stdout, show_progress: bool = True) -> str:
    """Loads the model, generates one completion of `prompt` and prints its text as it streams.
    Returns the finish reason. Raises ValueError for invalid parameters or prompts."""
    from jaxserve.engine import Engine
    from jaxserve.server.launch import model_loader
    from jaxserve.server.streaming import RequestRun

    if params.n != 1:
        raise ValueError("generate prints one sample: n must be 1")
    core, tokenizer, _ = model_loader(model, engine_cfg, show_progress)()
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}]) if chat else tokenizer.encode(prompt)
    if not ids:
        raise ValueError("the prompt encodes to zero tokens")

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


def convert(src: str, dst: str, dtype: str | None = None) -> Path:
    """HF safetensors (or a converted dir) at src -> orbax checkpoint + HF metadata at dst."""
    import jax.numpy as jnp

    from checkpoints import load_model, orbax_io, resolve_model_dir
    from jaxserve.config import ModelConfig
    from jaxserve.llm import resolve_dtype
    from jaxserve.sharding import make_mesh

    src_dir = resolve_model_dir(src)
    target = resolve_dtype(dtype, "float32") if dtype else jnp.dtype(ModelConfig.from_hf(src_dir).dtype)
    _, weights = load_model(src_dir, make_mesh(1, 1), target)
    return orbax_io.save(weights, dst, src_model_dir=src_dir)


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
    return int(module.main(argv) or 0)
