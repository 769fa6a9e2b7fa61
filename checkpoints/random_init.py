"""Random weights drawn on the devices from config.json alone: `--load-format dummy`.

For benchmarks and device checks at a real model's shape without its checkpoint (nothing is read
but config.json and the tokenizer): each leaf of `abstract(cfg)` is drawn by a small jitted program
straight onto its sharding, so an 8B model's 16 GB never pass through the host. Values as
`weights.init_random` gives them on the host: normal(0, std) for projections and embeddings, ones
for norms, zeros for biases. Online-quantized leaves are drawn in float32 and quantized on the
device by the rule a loading checkpoint goes through (quant/host.quantize).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxserve.parallel import sharding
from jaxserve.quant.mxfp4 import RANDOM_BYTES
from jaxserve.core.config import ModelConfig
from jaxserve.model import weights as W
from jaxserve.model.param_spec import ParamSpec
from jaxserve.quant import host as quant_host

DEFAULT_STD = 0.02


def random_weights(cfg: ModelConfig, mesh: Mesh, dtype: Any = jnp.float32,
                   rules: sharding.Rules = sharding.DEFAULT_RULES, seed: int = 0,
                   std: float = DEFAULT_STD) -> W.Weights:
    """The weight pytree of `cfg`, random (seeded: the same seed gives the same weights on any
    mesh), each leaf placed as `weights.shardings` says."""
    specs = W.abstract(cfg, dtype)
    is_leaf = lambda x: W.is_spec(x) or W.is_quantized(x)  # noqa: E731
    leaves, treedef = jax.tree.flatten(specs, is_leaf=is_leaf)
    placements = treedef.flatten_up_to(W.shardings(specs, cfg, mesh, rules))
    key = jax.random.key(seed)
    drawn = [_draw(spec, placement, jax.random.fold_in(key, i), std)
             for i, (spec, placement) in enumerate(zip(leaves, placements))]
    return jax.tree.unflatten(treedef, drawn)


def _draw(spec: Any, placement: Any, key: jax.Array, std: float) -> Any:
    if not W.is_quantized(spec):
        return _plain(spec, placement, std)(key)
    if getattr(spec, "zero_point", None) is not None or hasattr(spec, "perm"):
        raise ValueError("random weights of a zero-point or activation-order scheme are not supported; "
                         "load a checkpoint")
    values, scale = _quantized(spec.qvalue, spec.scale, placement.qvalue, placement.scale, std)(key)
    return spec.replace(qvalue=values, scale=scale)


# Layers repeat the same few leaf shapes: one program per distinct (spec, placement), reused.
@functools.lru_cache(maxsize=None)
def _plain(spec: ParamSpec, placement: Any, std: float) -> Any:
    dtype = jnp.dtype(spec.dtype)

    def draw(key: jax.Array) -> jax.Array:
        if spec.init == "ones":
            return jnp.ones(spec.shape, dtype)
        if spec.init == "zeros":
            return jnp.zeros(spec.shape, dtype)
        if spec.init in RANDOM_BYTES:  # packed MXFP4 experts
            return jax.random.randint(key, spec.shape, *RANDOM_BYTES[spec.init], jnp.int32).astype(dtype)
        return (jax.random.normal(key, spec.shape, jnp.float32) * std).astype(dtype)

    return jax.jit(draw, out_shardings=placement)


@functools.lru_cache(maxsize=None)
def _quantized(values: ParamSpec, scale: ParamSpec, values_at: Any, scale_at: Any, std: float) -> Any:
    def draw(key: jax.Array) -> tuple[jax.Array, jax.Array]:
        w = jax.random.normal(key, values.shape, jnp.float32) * std
        q, s = quant_host.quantize(w, values.dtype, scale.shape, xp=jnp)
        return q, s.astype(scale.dtype)

    return jax.jit(draw, out_shardings=(values_at, scale_at))
