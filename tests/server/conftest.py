"""Server test fixtures: one warmed-up engine core per session (shared by every test module's server).

The warm-up writes a persistent XLA compilation cache into a session temp dir, which the
`jaxserve serve` subprocess test reuses; the cache is switched off again in this process afterwards
so no other test module is affected by it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from jaxserve.config import EngineConfig
from server_utils import MODEL, TEST_ENGINE


@pytest.fixture(scope="session")
def xla_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("xla-cache")


@pytest.fixture(scope="session")
def loaded_model(xla_cache_dir: Path) -> tuple[Any, Any, Path]:
    """(EngineCore, Tokenizer, model_dir) of the embedded default model, warmed up."""
    import jax
    from jax._src import compilation_cache  # no public API turns the persistent cache off again

    from jaxserve.llm import load_engine_core

    cfg = EngineConfig(model_id=MODEL, compilation_cache_dir=str(xla_cache_dir), **TEST_ENGINE)
    loaded = load_engine_core(None, cfg)
    jax.config.update("jax_compilation_cache_dir", None)
    compilation_cache.reset_cache()
    return loaded
