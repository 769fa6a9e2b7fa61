"""`--speculative-config`: vLLM's JSON shape, checked into one frozen description (host, no jax).

    {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": a, "prompt_lookup_max": b}
    {"method": "draft_model" | "eagle3", "model": DIR, "num_speculative_tokens": k}
    {"method": "mtp", "num_speculative_tokens": k}   the served checkpoint's MTP layer ("model":
        the directory that holds it, filled in with the served model's when not given)
    optional for every method: "disable_by_batch_size": n (no speculation while more than n sequences
    are enqueued: running or waiting)
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

METHODS = ("ngram", "draft_model", "eagle3", "mtp")
_KEYS = {
    "ngram": {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "disable_by_batch_size"},
    "draft_model": {"method", "model", "num_speculative_tokens", "disable_by_batch_size"},
    "eagle3": {"method", "model", "num_speculative_tokens", "disable_by_batch_size"},
    "mtp": {"method", "model", "num_speculative_tokens", "disable_by_batch_size"},
}
MAX_SPECULATIVE_TOKENS = 16


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 1          # ngram: shortest suffix n-gram that may match
    prompt_lookup_max: int = 4          # ngram: longest, tried first
    model: str | None = None            # draft_model / eagle3: the draft's directory
    disable_by_batch_size: int | None = None

    @classmethod
    def parse(cls, text: str | dict[str, Any]) -> "SpeculativeConfig":
        """From the flag's JSON (or its dict); ValueError names the bad field."""
        if isinstance(text, str):
            try:
                raw = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"--speculative-config is not JSON: {e}") from None
        else:
            raw = dict(text)
        if not isinstance(raw, dict):
            raise ValueError("--speculative-config must be a JSON object")
        method = raw.get("method")
        if method not in METHODS:
            raise ValueError(f"--speculative-config method {method!r} is not one of {', '.join(METHODS)}")
        unknown = set(raw) - _KEYS[method]
        if unknown:
            raise ValueError(f"--speculative-config: {', '.join(sorted(unknown))} not allowed for method {method!r} "
                             f"(allowed: {', '.join(sorted(_KEYS[method]))})")
        if "num_speculative_tokens" not in raw:
            raise ValueError("--speculative-config needs num_speculative_tokens")
        if method in ("draft_model", "eagle3") and not raw.get("model"):
            raise ValueError(f"--speculative-config method {method!r} needs a model directory")
        return cls(**raw)

    def __post_init__(self) -> None:
        def positive(name: str, value: Any, upper: int | None = None) -> None:
            if not isinstance(value, int) or isinstance(value, bool) or value < 1 or (upper and value > upper):
                bound = f" and at most {upper}" if upper else ""
                raise ValueError(f"--speculative-config {name} must be a positive integer{bound}, got {value!r}")

        positive("num_speculative_tokens", self.num_speculative_tokens, MAX_SPECULATIVE_TOKENS)
        positive("prompt_lookup_min", self.prompt_lookup_min)
        positive("prompt_lookup_max", self.prompt_lookup_max)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"--speculative-config prompt_lookup_min {self.prompt_lookup_min} exceeds "
                             f"prompt_lookup_max {self.prompt_lookup_max}")
        if self.disable_by_batch_size is not None:
            positive("disable_by_batch_size", self.disable_by_batch_size)

    @property
    def model_proposer(self) -> bool:
        """Drafts come from a model's own layers run on the device (not from the host's n-grams)."""
        return self.method != "ngram"

    def active(self, enqueued: int) -> bool:
        """Whether steps speculate with `enqueued` sequences running or waiting (off above
        disable_by_batch_size)."""
        return self.disable_by_batch_size is None or enqueued <= self.disable_by_batch_size
