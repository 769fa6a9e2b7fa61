"""Checkpoint formats -> the jaxserve weight pytree (see checkpoints/hf.py and orbax_io.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax.numpy as jnp
from jax.sharding import Mesh

from checkpoints import orbax_io
from checkpoints.hf import load_weights, resolve_model_dir
from jaxserve.config import ModelConfig
from jaxserve.model.weights import Weights


def load_model(name_or_path: str | Path, mesh: Mesh, dtype: Any = jnp.float32) -> tuple[ModelConfig, Weights]:
    """Config and sharded weights from a HF directory, a cached hub id, or a converted directory."""
    model_dir = resolve_model_dir(name_or_path)
    cfg = ModelConfig.from_hf(model_dir)
    if orbax_io.is_converted(model_dir):
        return cfg, orbax_io.restore(model_dir, cfg, mesh, dtype)
    return cfg, load_weights(model_dir, cfg, mesh, dtype)


__all__ = ["load_model", "load_weights", "resolve_model_dir", "orbax_io"]
