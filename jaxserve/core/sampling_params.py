"""Per-request sampling parameters (OpenAI / vLLM vocabulary) and their validation.

Host-side only: no jax here. `validate(vocab_size)` is called once per request at submit; every
error is a `ValueError` whose message starts with the offending field's name, so the server can
turn it into a 400 that names the field.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jaxserve.structured.spec import StructuredOutputs

MAX_N = 64                  # samples per request
MAX_TEMPERATURE = 100.0
MAX_LOGIT_BIAS = 300        # entries per request (OpenAI accepts up to 300 biased tokens)
MAX_ABS_LOGIT_BIAS = 100.0
MAX_ABS_PRESENCE_FREQUENCY = 2.0
MAX_LOGPROBS = 20           # alternatives returned per token (= the sampler's top-20)
MAX_STOP_STRINGS = 16
MAX_STOP_TOKEN_IDS = 64     # bounds the sampler's per-row token table (see sampler.history_buckets)
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


@dataclasses.dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0          # 0 => greedy
    top_p: float = 1.0
    top_k: int = -1                   # -1 or 0 => off
    min_p: float = 0.0
    repetition_penalty: float = 1.0   # transformers semantics, over prompt + output tokens
    presence_penalty: float = 0.0     # OpenAI semantics, over output tokens
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    max_tokens: int | None = 16       # None => up to the context limit
    min_tokens: int = 0
    stop: list[str] = dataclasses.field(default_factory=list)
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None       # None: off; 0..20: chosen token + that many alternatives
    skip_special_tokens: bool = True
    # Output constraint (JSON schema, regex, choice, grammar); the front end compiles it into
    # Request.grammar before the engine sees the request.
    structured_outputs: "StructuredOutputs | None" = None

    def validate(self, vocab_size: int) -> None:
        """Raise ValueError("<field> ...") for the first field that is out of range."""
        _check_int("n", self.n, 1, MAX_N)
        _check_float("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        _check_float("top_p", self.top_p, 0.0, 1.0)
        if self.top_p <= 0.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        _check_int("top_k", self.top_k, -1, None)
        _check_float("min_p", self.min_p, 0.0, 1.0)
        _check_float("repetition_penalty", self.repetition_penalty, 0.0, None)
        if self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        lim = MAX_ABS_PRESENCE_FREQUENCY
        _check_float("presence_penalty", self.presence_penalty, -lim, lim)
        _check_float("frequency_penalty", self.frequency_penalty, -lim, lim)
        self._validate_logit_bias(vocab_size)
        if self.seed is not None:
            _check_int("seed", self.seed, INT64_MIN, INT64_MAX)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, 1, None)
        _check_int("min_tokens", self.min_tokens, 0, self.max_tokens)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        self._validate_stops(vocab_size)
        for name in ("ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.structured_outputs is not None:
            from jaxserve.structured.spec import StructuredOutputs

            if not isinstance(self.structured_outputs, StructuredOutputs):
                raise ValueError(f"structured_outputs must be a StructuredOutputs, got "
                                 f"{type(self.structured_outputs).__name__}")
            self.structured_outputs.validate()

    def _validate_logit_bias(self, vocab_size: int) -> None:
        if self.logit_bias is None:
            return
        if not isinstance(self.logit_bias, dict):
            raise ValueError(
                f"logit_bias must be a dict of token id -> bias, got {self.logit_bias!r}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(
                f"logit_bias may hold at most {MAX_LOGIT_BIAS} entries, got {len(self.logit_bias)}")
        for tok, bias in self.logit_bias.items():
            if not _is_int(tok) or not 0 <= tok < vocab_size:
                raise ValueError(f"logit_bias key {tok!r} is not a token id in [0, {vocab_size})")
            if not _is_real(bias) or not math.isfinite(bias) or abs(bias) > MAX_ABS_LOGIT_BIAS:
                raise ValueError(f"logit_bias value for token {tok} must be in "
                                 f"[-{MAX_ABS_LOGIT_BIAS:g}, {MAX_ABS_LOGIT_BIAS:g}], got {bias!r}")

    def _validate_stops(self, vocab_size: int) -> None:
        if not isinstance(self.stop, list) or not all(isinstance(s, str) for s in self.stop):
            raise ValueError(f"stop must be a list of strings, got {self.stop!r}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(
                f"stop may hold at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        if any(s == "" for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if not isinstance(self.stop_token_ids, list):
            raise ValueError(
                f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids may hold at most {MAX_STOP_TOKEN_IDS} ids, "
                             f"got {len(self.stop_token_ids)}")
        for tok in self.stop_token_ids:
            if not _is_int(tok) or not 0 <= tok < vocab_size:
                raise ValueError(
                    f"stop_token_ids entry {tok!r} is not a token id in [0, {vocab_size})")


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _check_int(name: str, value: object, lo: int | None, hi: int | None) -> None:
    if not _is_int(value):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        bounds = f"[{'-inf' if lo is None else lo}, {'inf' if hi is None else hi}]"
        raise ValueError(f"{name} must be in {bounds}, got {value!r}")


def _check_float(name: str, value: object, lo: float | None, hi: float | None) -> None:
    if not _is_real(value) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        bounds = f"[{'-inf' if lo is None else lo}, {'inf' if hi is None else hi}]"
        raise ValueError(f"{name} must be in {bounds}, got {value!r}")
