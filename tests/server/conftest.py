"""Server test fixtures: one warmed-up engine core per session (shared by every test module's server).

Its warm-up writes the suite's persistent compilation cache (tests/conftest.py), which the
`jaxserve serve` subprocess test reuses.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from jaxserve.core.config import EngineConfig
from server_utils import MODEL, TEST_ENGINE


@pytest.fixture(scope="session")
def xla_cache_dir() -> Path:
    import jax

    return Path(jax.config.jax_compilation_cache_dir)


@pytest.fixture(scope="session")
def loaded_model(xla_cache_dir: Path) -> tuple[Any, Any, Path]:
    """(EngineCore, Tokenizer, model_dir) of the embedded default model, warmed up."""
    from jaxserve.engine.loading import load_engine_core

    cfg = EngineConfig(model_id=MODEL, compilation_cache_dir=str(xla_cache_dir), **TEST_ENGINE)
    return load_engine_core(None, cfg)
