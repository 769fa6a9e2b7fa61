"""Loading a model into an engine, and the offline batch API (`LLM.generate`).

`load_engine_core` is the one path from a model name to a warmed-up EngineCore: the server, the
CLI and `LLM` all go through it. `LLM.generate` drives the same EngineCore synchronously and
detokenizes with the same incremental detokenizer the server streams with.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import uuid
from pathlib import Path
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from tqdm import tqdm

from checkpoints import load_model, resolve_model_dir
from jaxserve.config import EngineConfig, ModelConfig, normalize_dtype_name
from jaxserve.default_model import DISPLAY_NAME
from jaxserve.detokenizer import IncrementalDetokenizer
from jaxserve.engine import EngineCore
from jaxserve.layouts import layout_rules
from jaxserve.request import FinishReason, Request
from jaxserve.sampling_params import SamplingParams
from jaxserve.sharding import make_mesh
from jaxserve.structured.compiler import GrammarCompiler
from jaxserve.tokenizer import Tokenizer, check_same_vocabulary

logger = logging.getLogger("jaxserve")


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
    model_dir = model_dir_of(model)
    spec = engine_cfg.speculative_config
    if spec is not None and spec.method == "draft_model":
        check_same_vocabulary(model_dir, resolve_model_dir(spec.model))
    elif spec is not None and spec.method == "eagle3":  # fails before the target loads
        from checkpoints.eagle3 import read_config
        read_config(spec.model, ModelConfig.from_hf(model_dir))
    enable_compilation_cache(engine_cfg.compilation_cache_dir)
    dtype = resolve_dtype(engine_cfg.dtype, ModelConfig.from_hf(model_dir).dtype)
    mesh = make_mesh(*engine_cfg.mesh_shape)
    model_cfg, weights = load_model(model_dir, mesh, dtype, engine_cfg.quantization,
                                    layout_rules(engine_cfg.layout, ModelConfig.from_hf(model_dir)),
                                    engine_cfg.load_format)
    # The KV pool is filled asynchronously on the device: the tokenizer loads meanwhile.
    core = EngineCore(model_cfg, weights, engine_cfg, mesh, dtype)
    tokenizer = tokenizer or Tokenizer.from_pretrained(model_dir)
    if warmup:
        core.runner.warmup(progress)
    return core, tokenizer, model_dir


def load_with_progress(model: str | Path | None, engine_cfg: EngineConfig, show_progress: bool = True,
                       tokenizer: Tokenizer | None = None,
                       before_warmup: Callable[[EngineCore], None] | None = None) -> tuple[EngineCore, Tokenizer, Path]:
    """load_engine_core with progress bars on stderr: one while the model loads, one tick per
    compiled program while every bucket warms up (minutes on large models). before_warmup: called
    with the built engine before it compiles anything."""
    name = str(model) if model is not None else DISPLAY_NAME
    with tqdm(total=1, desc=f"loading {name}", file=sys.stderr, disable=not show_progress) as bar:
        core, tokenizer, model_dir = load_engine_core(model, engine_cfg, warmup=False, tokenizer=tokenizer)
        bar.update(1)
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
        core.runner.warmup(progress)
    finally:
        if compile_bar is not None:
            compile_bar.close()
    return core, tokenizer, model_dir


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str
    logprobs: list[float] | None = None


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_prompt_tokens: int = 0


class LLM:
    """Offline generation: `LLM(model=DIR).generate(prompts, SamplingParams(...))`."""

    def __init__(self, model: str | Path | None = None, *, show_progress: bool = True,
                 **engine_kwargs: Any) -> None:
        """engine_kwargs are EngineConfig fields. show_progress: the server's progress bars on stderr
        while the model loads and every bucket compiles (minutes on large models)."""
        from jaxserve.quiet import quiet_startup

        quiet_startup()
        model_id = str(model) if model is not None else "jaxserve-tiny"
        self.engine_cfg = EngineConfig(model_id=model_id, **engine_kwargs)
        self.core, self.tokenizer, self.model_dir = load_with_progress(model, self.engine_cfg, show_progress)
        self._grammars: GrammarCompiler | None = None

    @property
    def grammars(self) -> GrammarCompiler:
        """Compiles SamplingParams.structured_outputs (built on first use: ~1.5 s for a 150k vocabulary)."""
        if self._grammars is None:
            self._grammars = GrammarCompiler(self.tokenizer.hf, self.core.model_cfg.vocab_size,
                                             self.tokenizer.eos_token_ids)
        return self._grammars

    def generate(self, prompts: Sequence[str | Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 lora_name: str | None = None) -> list[RequestOutput]:
        """Runs every prompt (text or token ids) through the continuous-batching engine (on LoRA
        adapter `lora_name` when given: LLM(enable_lora=True, lora_modules=((name, path), ...)))."""
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(sampling_params)} sampling params for {len(prompts)} prompts")
        states: dict[str, _OfflineRequest] = {}
        order = []
        for prompt, params in zip(prompts, sampling_params):
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            rid = uuid.uuid4().hex
            grammar = None
            if params.structured_outputs is not None:
                grammar = self.grammars.compile(params.structured_outputs)
            request = self.core.add_request(Request(rid, ids, params, self.tokenizer.eos_token_ids, grammar=grammar,
                                                    lora_name=lora_name))
            states[rid] = _OfflineRequest(request, self.tokenizer)
            order.append(rid)
        while self.core.has_work():
            for event in self.core.step():
                state = states[event.request_id]
                if state.on_event(event):  # a stop string ended this sample
                    self.core.finish(event.request_id, event.sample_index)
        return [states[rid].output() for rid in order]


class _OfflineRequest:
    def __init__(self, request: Request, tokenizer: Tokenizer) -> None:
        self.request = request
        p = request.params
        self.detok = [IncrementalDetokenizer(tokenizer, request.prompt_token_ids, p.skip_special_tokens, p.stop)
                      for _ in range(p.n)]
        self.text = [""] * p.n
        self.ids: list[list[int]] = [[] for _ in range(p.n)]
        self.logprobs: list[list[float]] = [[] for _ in range(p.n)]
        self.finish: list[str | None] = [None] * p.n
        self.cached = 0

    def on_event(self, event) -> bool:
        i = event.sample_index
        if self.finish[i] is not None:
            return False  # tokens sampled after a stop string, in the step that was in flight
        self.cached = event.num_cached_prompt_tokens
        if event.token_id is not None:
            self.ids[i].append(event.token_id)
            if event.logprob is not None:
                self.logprobs[i].append(event.logprob)
            result = self.detok[i].push([event.token_id])
            self.text[i] += result.delta
            if result.stopped:
                self.finish[i] = FinishReason.STOP.value
                return True
        if event.finish_reason is not None:
            self.text[i] += self.detok[i].flush()
            self.finish[i] = event.finish_reason.value
        return False

    def output(self) -> RequestOutput:
        outs = [CompletionOutput(i, self.text[i], self.ids[i], self.finish[i] or "abort",
                                 self.logprobs[i] if self.request.params.logprobs is not None else None)
                for i in range(self.request.params.n)]
        return RequestOutput(self.request.request_id, self.request.prompt_token_ids, outs, self.cached)
