"""Checkpoint formats -> the jaxserve weight pytree (see checkpoints/hf.py and orbax_io.py)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable

import jax.numpy as jnp
from jax.sharding import Mesh

from checkpoints import orbax_io
from checkpoints.hf import load_weights, resolve_model_dir, tensor_names
from checkpoints.quantized import quantized_marker_part
from checkpoints.random_init import random_weights
from jaxserve.parallel import sharding
from jaxserve.core.config import LOAD_FORMATS, ModelConfig
from jaxserve.model.weights import Weights
from jaxserve.quant.scheme import online_scheme


def load_model(name_or_path: str | Path, mesh: Mesh, dtype: Any = jnp.float32,
               quantization: str | None = None,
               rules: sharding.Rules = sharding.DEFAULT_RULES,
               load_format: str = "auto",
               progress: Callable[[int, int], None] | None = None) -> tuple[ModelConfig, Weights]:
    """Config and sharded weights from a HF directory, a cached hub id, or a converted directory.

    quantization: an online scheme ("int8", "int4", "fp8") applied while the tensors load; a
    converted directory keeps the scheme it was converted with. rules: the logical-axis rules
    the weights are placed by (layouts.RULE_SETS; default: tensor parallelism). load_format:
    "auto" reads the weights; "dummy" draws random ones on the devices from config.json alone
    (random_init.py: benchmarks at a model's shape without its checkpoint). progress: called with
    (tensors read, tensors in all) while a Hugging Face checkpoint loads (not for the others: an
    orbax restore is one call, random weights read nothing)."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {load_format!r}")
    model_dir = resolve_model_dir(name_or_path)
    cfg = ModelConfig.from_hf(model_dir)
    if load_format == "dummy":
        if quantization is not None:
            cfg = dataclasses.replace(cfg, quantization=online_scheme(quantization))
        return cfg, random_weights(cfg, mesh, dtype, rules)
    if orbax_io.is_converted(model_dir):
        saved = orbax_io.saved_quantization(model_dir)
        if quantization is not None and (saved is None or saved.method != quantization):
            raise ValueError(f"{model_dir} was converted {'without quantization' if saved is None else 'with ' + saved.method}"
                             f"; convert it again with --quantization {quantization}")
        cfg = dataclasses.replace(cfg, quantization=saved)
        return cfg, orbax_io.restore(model_dir, cfg, mesh, dtype, rules)
    if cfg.quantization is not None:  # a pre-quantized checkpoint
        if quantization is not None:
            raise ValueError(f"{model_dir} is already quantized ({cfg.quantization.method}); drop --quantization "
                             f"{quantization}")
        # Formats leave lm_head out by listing it, or just by not quantizing it: the tensors decide.
        lm_head = f"lm_head.{quantized_marker_part(cfg.quantization)}" in tensor_names(model_dir)
        cfg = dataclasses.replace(cfg, quantization=dataclasses.replace(cfg.quantization, lm_head=lm_head))
    elif quantization is not None:
        cfg = dataclasses.replace(cfg, quantization=online_scheme(quantization))
    return cfg, load_weights(model_dir, cfg, mesh, dtype, rules, progress=progress)


__all__ = ["LOAD_FORMATS", "load_model", "load_weights", "random_weights", "resolve_model_dir", "orbax_io"]


def load_proposer(spec: Any, target: ModelConfig, mesh: Mesh, dtype: Any = jnp.float32,
                  quantization: str | None = None, rules: sharding.Rules = sharding.DEFAULT_RULES) -> tuple[Any, Any]:
    """The (config, weights) of a speculative proposer that runs on the device (`spec`: a
    SpeculativeConfig whose method is draft_model, eagle3 or mtp), placed as the target is."""
    if spec.method == "draft_model":
        return load_model(spec.model, mesh, dtype, quantization, rules)
    if spec.method == "eagle3":
        from checkpoints.eagle3 import load_eagle3
        return load_eagle3(spec.model, target, mesh, dtype, rules)
    if spec.model is None:
        raise ValueError("--speculative-config method 'mtp' reads the MTP layer from the served checkpoint: "
                         "give the engine its directory as the config's \"model\" (serve and LLM do)")
    from checkpoints.mtp import load_mtp
    return load_mtp(spec.model, target, mesh, dtype, rules)
