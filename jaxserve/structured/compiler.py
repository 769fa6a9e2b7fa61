"""Constraint -> compiled grammar, checked and cached, before a request reaches the engine.

`GrammarCompiler` owns llguidance's view of the tokenizer (built once: ~1.5 s for the Qwen
vocabulary) and an LRU of compiled grammars keyed by the constraint's text. Compiling runs on a
worker thread under a deadline: a schema that does not compile, exceeds llguidance's size limits
or takes too long raises `GrammarError`, a ValueError whose message names the field, so the server
answers 400 and the engine never sees the request.
"""

from __future__ import annotations

import collections
import copy
import concurrent.futures
import threading
from typing import Any, Iterable

from jaxserve.structured.guide import CompiledGrammar
from jaxserve.structured.spec import StructuredOutputs, compose

DEFAULT_CACHE_SIZE = 256
DEFAULT_TIMEOUT_S = 10.0
MAX_GRAMMAR_SYMBOLS = 500_000   # llguidance's default cap on grammar size, stated here on purpose
MAX_LEXER_FUEL = 2_000_000      # bounds regex/lexer construction (~50k units per ms)


class GrammarError(ValueError):
    """The constraint cannot be used: its message starts with the field's name."""


def _tokenizer_json(hf_tokenizer: Any) -> str:
    """The fast tokenizer's tokenizer.json, added tokens included, as llguidance reads it: its
    `hf.from_tokenizer` copies the whole backend first (0.6 s of a warm start, holding the GIL) only
    to switch off padding and truncation, which jaxserve's tokenizers never switch on."""
    backend = hf_tokenizer.backend_tokenizer
    if backend.padding is not None or backend.truncation is not None:
        backend = copy.copy(backend)
        backend.no_padding()
        backend.no_truncation()
    return backend.to_str()


class GrammarCompiler:
    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_ids: Iterable[int],
                 cache_size: int = DEFAULT_CACHE_SIZE, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        """hf_tokenizer: a transformers fast tokenizer; vocab_size: the model's logits width (masks
        have a bit per id up to it; ids the tokenizer lacks are never allowed)."""
        import llguidance

        self._llg = llguidance
        self.vocab_size = vocab_size
        self.tokenizer = llguidance.LLTokenizer(_tokenizer_json(hf_tokenizer), n_vocab=vocab_size,
                                                eos_token=sorted(eos_token_ids))
        self.limits = llguidance.LLParserLimits(max_grammar_size=MAX_GRAMMAR_SYMBOLS,
                                                initial_lexer_fuel=MAX_LEXER_FUEL, verbose_errors=False)
        self.timeout_s = timeout_s
        self._cache: collections.OrderedDict[str, CompiledGrammar] = collections.OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="jaxserve-grammar")
        self.hits = 0
        self.misses = 0

    def compile(self, spec: StructuredOutputs, prefix: str = "", field: str | None = None) -> CompiledGrammar:
        """The compiled grammar of `spec` (behind the Lark `prefix`, if any); raises GrammarError
        naming `field` (default: structured_outputs.<kind>)."""
        try:
            spec.validate()
            field = field or f"structured_outputs.{spec.kind}"
            text = compose(spec.grammar_entry(), prefix)
        except ValueError as e:
            raise GrammarError(str(e)) from None
        return self.compile_text(text, field)

    def compile_text(self, text: str, field: str) -> CompiledGrammar:
        """An llguidance grammar text (Lark, or the JSON top-level form) -> compiled grammar."""
        with self._lock:
            hit = self._cache.get(text)
            if hit is not None:
                self._cache.move_to_end(text)
                self.hits += 1
                return hit
        future = self._pool.submit(self._build, text)
        try:
            matcher = future.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            raise GrammarError(f"{field} took longer than {self.timeout_s:g}s to compile; simplify it") from None
        if matcher.is_error():
            raise GrammarError(f"{field} could not be compiled: {_first_line(matcher.get_error())}")
        compiled = CompiledGrammar(matcher, text, self.tokenizer)
        with self._lock:
            self.misses += 1
            self._cache[text] = compiled
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _build(self, text: str) -> Any:
        return self._llg.LLMatcher(self.tokenizer, text, log_level=0, limits=self.limits)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _first_line(message: str) -> str:
    return message.strip().splitlines()[0] if message.strip() else "unknown error"
