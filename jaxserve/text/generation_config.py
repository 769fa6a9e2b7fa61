"""A model's generation_config.json: the ids that end generation, and its recommended sampling
settings, the defaults of requests that leave them out (vLLM's `--generation-config`).

Host side: plain JSON, no transformers import.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

FILE = "generation_config.json"
# its names for what a request may leave out (the same names in the request)
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def _read(directory: str | Path) -> dict[str, Any]:
    path = Path(directory) / FILE
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def eos_token_ids(model_dir: str | Path) -> list[int]:
    eos = _read(model_dir).get("eos_token_id")
    if eos is None:
        return []
    return [int(e) for e in eos] if isinstance(eos, list) else [int(eos)]


def check_choice(choice: str) -> str:
    """`--generation-config`: 'auto', 'vllm', or a directory that holds the file (else ValueError,
    before any model loads)."""
    if choice not in ("auto", "vllm") and not (Path(choice).expanduser() / FILE).is_file():
        raise ValueError(f"--generation-config {choice!r}: no {FILE} there")
    return choice


def sampling_defaults(model_dir: str | Path, choice: str = "auto") -> dict[str, Any]:
    """`choice`: 'auto' (the model directory's generation_config.json, if it has one), 'vllm' (no
    defaults: OpenAI's), or a directory holding a generation_config.json."""
    if choice == "vllm":
        return {}
    data = _read(model_dir if choice == "auto" else Path(check_choice(choice)).expanduser())
    found = {name: data[name] for name in SAMPLING_FIELDS if isinstance(data.get(name), (int, float))}
    if found.get("top_k") == 0:  # transformers' "no top-k"; a request says -1
        found["top_k"] = -1
    return found
