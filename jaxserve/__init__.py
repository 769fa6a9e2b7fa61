"""jaxserve: a JAX/XLA serving engine for decoder-only language models.

    from jaxserve import LLM, SamplingParams

The package's rooms (docs/ARCHITECTURE.md): entrypoints, server, disagg, distributed, planning,
engine, runner, lora, model, parallel, core, quant, speculative, structured, text. `LLM` and
`SamplingParams` load on first use, so importing a room (the scheduler, core) does not start jax.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from jaxserve.core.host_memory import tune_malloc

tune_malloc()  # before jax starts its threads: see core/host_memory.py

if TYPE_CHECKING:
    from jaxserve.core.sampling_params import SamplingParams
    from jaxserve.entrypoints.llm import LLM, RequestOutput

_EXPORTS = {"LLM": "jaxserve.entrypoints.llm", "RequestOutput": "jaxserve.entrypoints.llm",
            "SamplingParams": "jaxserve.core.sampling_params"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'jaxserve' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_EXPORTS[name]), name)
