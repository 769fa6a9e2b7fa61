"""The offline batch API (`LLM.generate`): vLLM's `LLM` over the same engine the server runs.

`LLM` loads through `engine/loading.load_engine_core`, the server's and the CLI's path too.
`LLM.generate` drives the same EngineCore synchronously and detokenizes with the same incremental
detokenizer the server streams with.
"""

from __future__ import annotations

import dataclasses
import logging
import uuid
from pathlib import Path
from typing import Any, Sequence


from jaxserve.core.config import EngineConfig
from jaxserve.text.detokenizer import IncrementalDetokenizer
from jaxserve.engine.loading import load_with_progress
from jaxserve.core.request import FinishReason, Request
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.structured.compiler import GrammarCompiler
from jaxserve.text.tokenizer import Tokenizer

logger = logging.getLogger("jaxserve")


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
        """engine_kwargs are EngineConfig fields (warmup="full" compiles every bucket before
        returning; the default "background" only the smallest). show_progress: the server's progress
        bars on stderr while the model loads and the first programs compile."""
        from jaxserve.core.quiet import quiet_startup

        quiet_startup()
        model_id = str(model) if model is not None else "jaxserve-tiny"
        # generating starts once the smallest bucket compiles; the rest compile meanwhile (as serve)
        engine_kwargs.setdefault("warmup", "background")
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
