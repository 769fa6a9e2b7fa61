"""From a model name to a warmed-up EngineCore: the one path the server, the CLI, `LLM` and a
multi-host follower all take (the checkpoint, the mesh and layout, the persistent compilation
cache, the engine, its tokenizer, then the warm-up)."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from checkpoints import load_model, resolve_model_dir
from jaxserve.core.config import EngineConfig, ModelConfig
from jaxserve.core.hf_families import normalize_dtype_name
from jaxserve.default_model import DISPLAY_NAME
from jaxserve.engine.engine_core import EngineCore
from jaxserve.parallel.layouts import layout_rules
from jaxserve.parallel.sharding import make_mesh
from jaxserve.text.tokenizer import Tokenizer, check_same_vocabulary


def model_dir_of(model: str | Path | None) -> Path:
    """A model name -> its local directory (None: the embedded default, written on first use)."""
    if model is None:
        from jaxserve.default_model import ensure_default_model
        return ensure_default_model()
    return resolve_model_dir(model)


def resolve_dtype(requested: str | None, checkpoint_dtype: str) -> Any:
    """float32 on CPU (bf16 matmuls are slow there), else the checkpoint's dtype; "auto" = None."""
    if requested in (None, "auto"):
        return jnp.float32 if jax.default_backend() == "cpu" else jnp.dtype(checkpoint_dtype)
    return jnp.dtype(normalize_dtype_name(requested))


def default_compilation_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "jaxserve" / "xla"


def enable_compilation_cache(directory: str | None) -> Path | None:
    """Turns on JAX's persistent compilation cache (None: the user's cache dir; "": off), so a
    restart loads its programs instead of compiling them. Returns the directory in use."""
    if directory == "":
        return None
    path = Path(directory).expanduser() if directory is not None else default_compilation_cache_dir()
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path


def load_engine_core(model: str | Path | None, engine_cfg: EngineConfig,
                     progress: Callable[[int, int, str], None] | None = None, warmup: bool = True,
                     tokenizer: Tokenizer | None = None) -> tuple[EngineCore, Tokenizer, Path]:
    """Model dir (None: the embedded default) -> (warmed-up EngineCore, tokenizer, resolved dir).
    `tokenizer`: the model's tokenizer when the caller has loaded it already."""
    core, tokenizer_load, model_dir = _build(model, engine_cfg, tokenizer)
    if warmup:
        core.runner.warmup(progress, background=engine_cfg.warmup == "background")
    return core, tokenizer_load.result(), model_dir


class LoadBar:
    """The loading bar's ticks: one per checkpoint tensor read, then one for the engine (its KV pool
    is allocated and zeroed: longer than the weights of a small model on a CPU). A loader that does
    not count (orbax restore, dummy weights) leaves two ticks: the weights, the engine."""

    def __init__(self, bar: tqdm) -> None:
        self.bar = bar

    def weights(self, done: int, total: int) -> None:
        """load_model's progress: (tensors read, tensors in the checkpoint)."""
        if self.bar.total != total + 1:
            self.bar.total = total + 1
        self.bar.update(done - self.bar.n)

    def engine(self) -> None:
        """The weights are placed (all of them, whether counted or not); the engine builds next."""
        self.bar.set_postfix_str("KV pool", refresh=False)
        self.bar.update(self.bar.total - 1 - self.bar.n)

    def done(self) -> None:
        self.bar.set_postfix_str("", refresh=False)
        self.bar.update(self.bar.total - self.bar.n)


def _build(model: str | Path | None, engine_cfg: EngineConfig, tokenizer: Tokenizer | None,
           bar: LoadBar | None = None) -> tuple[EngineCore, "Future[Tokenizer]", Path]:
    """The engine, not warmed up, and its tokenizer loading on a thread meanwhile (importing
    transformers and reading a 150k vocabulary take seconds of a warm start)."""
    if engine_cfg.attention_backend in ("auto", "cpu") and jax.default_backend() == "cpu":
        from kernels_pallas import cpu_decode_attention

        cpu_decode_attention.prepare()  # the native decode kernel's first build runs beside the load
        # (and beside writing the embedded model on first use)
    model_dir = model_dir_of(model)
    spec = engine_cfg.speculative_config
    if spec is not None and spec.method == "draft_model":
        check_same_vocabulary(model_dir, resolve_model_dir(spec.model))
    elif spec is not None and spec.method == "eagle3":  # fails before the target loads
        from checkpoints.eagle3 import read_config
        read_config(spec.model, ModelConfig.from_hf(model_dir))
    elif spec is not None and spec.method == "mtp":  # the served checkpoint holds the layer
        from jaxserve.model.mtp import MtpConfig
        MtpConfig.of(ModelConfig.from_hf(model_dir))
        if spec.model is None:
            engine_cfg = dataclasses.replace(engine_cfg, speculative_config=dataclasses.replace(spec, model=str(model_dir)))
    tokenizer_load: Future[Tokenizer] = Future()
    if tokenizer is not None:
        tokenizer_load.set_result(tokenizer)
    else:
        pool = ThreadPoolExecutor(1, thread_name_prefix="jaxserve-tokenizer")
        tokenizer_load = pool.submit(Tokenizer.from_pretrained, model_dir)
        pool.shutdown(wait=False)
    enable_compilation_cache(engine_cfg.compilation_cache_dir)
    dtype = resolve_dtype(engine_cfg.dtype, ModelConfig.from_hf(model_dir).dtype)
    mesh = make_mesh(*engine_cfg.mesh_shape)
    model_cfg, weights = load_model(model_dir, mesh, dtype, engine_cfg.quantization,
                                    layout_rules(engine_cfg.layout, ModelConfig.from_hf(model_dir)),
                                    engine_cfg.load_format, bar.weights if bar is not None else None)
    if bar is not None:
        bar.engine()
    return EngineCore(model_cfg, weights, engine_cfg, mesh, dtype), tokenizer_load, model_dir


def load_with_progress(model: str | Path | None, engine_cfg: EngineConfig, show_progress: bool = True,
                       tokenizer: Tokenizer | None = None,
                       before_warmup: Callable[[EngineCore], None] | None = None) -> tuple[EngineCore, Tokenizer, Path]:
    """load_engine_core with progress bars on stderr: one while the model loads (a tick per tensor
    read, see LoadBar), one tick per program compiled before serving. Log lines meanwhile are
    written above the bars, never on a bar's line. before_warmup: called with the built engine
    before it compiles anything."""
    # The root logger's console handlers write through tqdm.write while the bars show (uvicorn's
    # loggers propagate there too: launch.py); jaxserve's own loggers have no handlers of their own.
    with logging_redirect_tqdm() if show_progress else contextlib.nullcontext():
        return _load_with_bars(model, engine_cfg, show_progress, tokenizer, before_warmup)


def _load_with_bars(model: str | Path | None, engine_cfg: EngineConfig, show_progress: bool,
                    tokenizer: Tokenizer | None,
                    before_warmup: Callable[[EngineCore], None] | None) -> tuple[EngineCore, Tokenizer, Path]:
    name = str(model) if model is not None else DISPLAY_NAME
    # no rate: the ticks are tensors, then the engine
    with tqdm(total=2, desc=f"loading {name}", file=sys.stderr, disable=not show_progress, postfix="weights",
              bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}{postfix}]") as bar:
        load_bar = LoadBar(bar)
        core, tokenizer_load, model_dir = _build(model, engine_cfg, tokenizer, load_bar)
        load_bar.done()
    if before_warmup is not None:
        before_warmup(core)
    compile_bar: tqdm | None = None

    def progress(done: int, total: int, what: str) -> None:
        nonlocal compile_bar
        if compile_bar is None:
            compile_bar = tqdm(total=total, desc="compiling", unit="program", file=sys.stderr,
                               disable=not show_progress)
        compile_bar.set_postfix_str(what, refresh=False)
        compile_bar.update(done - compile_bar.n)

    try:
        core.runner.warmup(progress, background=engine_cfg.warmup == "background")
    finally:
        if compile_bar is not None:
            compile_bar.close()
    tokenizer = tokenizer_load.result()
    freeze_startup_heap()
    return core, tokenizer, model_dir


YOUNG_GC_THRESHOLD = 10_000  # see freeze_startup_heap


def freeze_startup_heap() -> None:
    """Moves every object alive after start-up (jax, transformers, the model's host structures:
    ~0.5 M objects) out of the garbage collector's sight (gc.freeze, after a collection). Without
    it each collection the step loop's allocations trigger walks them again: 21-23 ms per step at
    1024 running requests (scripts/bench_host.py), against ~2 ms frozen. What the requests create
    later is collected as usual. Unfrozen first, so a process that loads engines again (tests,
    notebooks) collects the cyclic garbage of the ones it dropped; ~0.1-0.25 s.

    The youngest generation's threshold is raised too (700 -> YOUNG_GC_THRESHOLD net allocations):
    a decode step allocates a few objects per row (its chunk, event, lists), which at 700 set off
    ~2 young collections per step at 256 rows and ~12 at 1024, each walking every request's
    younger objects: 5 % of the host's time per step at 256 rows, 15 % at 1024 (bench_host.py)."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    young, *older = gc.get_threshold()
    gc.set_threshold(max(young, YOUNG_GC_THRESHOLD), *older)
