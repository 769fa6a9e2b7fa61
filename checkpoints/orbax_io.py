"""Save and restore converted, sharded weights with orbax-checkpoint.

A converted model directory keeps the Hugging Face metadata (config.json, generation_config.json,
tokenizer files) beside an `orbax/` directory that holds the weight pytree in our layout, so
restore skips renaming and transposing and places every array straight onto its sharding.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import orbax.checkpoint as ocp
from jax.sharding import Mesh

from jaxserve.core.config import ModelConfig
from jaxserve.parallel import sharding
from jaxserve.model import weights as W
from jaxserve.quant.scheme import WeightQuant

ORBAX_SUBDIR = "orbax"
QUANTIZATION_FILE = "jaxserve_quantization.json"  # the WeightQuant the weights were saved with
_METADATA_GLOBS = ("config.json", "generation_config.json", "tokenizer*", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "*.tiktoken", "chat_template*", "README.md")


def is_converted(model_dir: str | Path) -> bool:
    return (Path(model_dir) / ORBAX_SUBDIR).is_dir()


def saved_quantization(model_dir: str | Path) -> WeightQuant | None:
    path = Path(model_dir) / QUANTIZATION_FILE
    if not path.is_file():
        return None
    raw = json.loads(path.read_text())
    return WeightQuant(**{**raw, "block": tuple(raw["block"]) if raw.get("block") else None})


def save(weights: W.Weights, dst: str | Path, src_model_dir: str | Path | None = None,
         quantization: WeightQuant | None = None) -> Path:
    """Writes `weights` under dst/orbax and copies the HF metadata files of src_model_dir;
    `quantization` (the scheme of quantized weights) is recorded beside them."""
    dst = Path(dst).absolute()
    if (dst / ORBAX_SUBDIR).exists():
        raise FileExistsError(f"{dst / ORBAX_SUBDIR} already exists; choose an empty destination")
    dst.mkdir(parents=True, exist_ok=True)
    if src_model_dir is not None:
        for pattern in _METADATA_GLOBS:
            for f in Path(src_model_dir).glob(pattern):
                if f.is_file():
                    shutil.copy2(f, dst / f.name)
    if quantization is not None:
        (dst / QUANTIZATION_FILE).write_text(json.dumps(dataclasses.asdict(quantization)))
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(dst / ORBAX_SUBDIR, weights)
    return dst


def restore(model_dir: str | Path, cfg: ModelConfig, mesh: Mesh, dtype: Any = jnp.float32,
            rules: sharding.Rules = sharding.DEFAULT_RULES) -> W.Weights:
    """Restores onto the shardings `mesh` implies (which may differ from the ones it was saved with)."""
    path = Path(model_dir).absolute() / ORBAX_SUBDIR
    if not path.is_dir():
        raise FileNotFoundError(f"no orbax checkpoint at {path}")
    target = W.abstract_arrays(cfg, dtype, mesh, rules)
    with ocp.StandardCheckpointer() as ckptr:
        try:
            return ckptr.restore(path, target)
        except ValueError as e:
            raise ValueError(f"orbax checkpoint at {path} does not match config.json: {e}") from e
