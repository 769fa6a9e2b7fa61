"""A model's recommended sampling settings (generation_config.json), the defaults of requests that
leave them out, as vLLM's `--generation-config` gives them.

Host side: plain JSON, no transformers import.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# generation_config.json's names for what a request may leave out (the same names in the request)
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def sampling_defaults(model_dir: str | Path, choice: str = "auto") -> dict[str, Any]:
    """`choice`: 'auto' (the model directory's generation_config.json), 'vllm' (no
    defaults: OpenAI's), or a directory holding a generation_config.json."""
    if choice == "vllm":
        return {}
    directory = Path(model_dir) if choice == "auto" else Path(choice).expanduser()
    path = directory / "generation_config.json"
    if not path.is_file():
        if choice == "auto":
            return {}
        raise ValueError(f"--generation-config {choice!r}: no generation_config.json there")
    data = json.loads(path.read_text(encoding="utf-8"))
    found = {name: data[name] for name in SAMPLING_FIELDS if isinstance(data.get(name), (int, float))}
    if found.get("top_k") == 0:  # transformers' "no top-k"; a request says -1
        found["top_k"] = -1
    return found
