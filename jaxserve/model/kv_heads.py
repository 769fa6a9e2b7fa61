"""KV heads duplicated up to the model axis: tensor parallelism wider than the KV head count.

With fewer KV heads than devices on the model axis (Qwen3-8B's 8 KV heads on 16 chips, a
2-KV-head model on 4), the KV heads cannot be split. Replicating them makes every device hold and
read the whole KV pool, and a Pallas kernel cannot be placed per device at all. Duplicating each
KV head `r = model_axis / num_kv_heads` times instead gives the model axis exactly one KV head per
device: the K/V projections are repeated along the head axis (each copy of head j sits next to the
others, `np.repeat` order), so query head h still attends to its own KV head: with G' = G / r
query heads per duplicated KV head, h // G' // r == h // G. Each device then stores only its own
head's pages, and the attention kernel runs shard-mapped as for any split.
"""

from __future__ import annotations

import dataclasses
import jax
import jax.numpy as jnp

from jaxserve.parallel import sharding
from jaxserve.core.config import ModelConfig
from jaxserve.parallel.kv_heads import duplicated_config, kv_duplication
from jaxserve.model.weights import LayerWeights, Weights


def repeat_kv(weights: Weights, factor: int) -> Weights:
    """The K/V projections (and their biases) with every KV head repeated `factor` times."""
    if factor == 1:
        return weights

    def layer(lw: LayerWeights) -> LayerWeights:
        def rep(w, axis):
            # A quantized projection repeats its values, scales and zero points alike; an input
            # permutation (activation order) is over the inputs, which do not change.
            if hasattr(w, "perm"):
                return w.replace(weight=rep(w.weight, axis))
            return jax.tree.map(lambda a: jnp.repeat(a, factor, axis=axis), w)
        # a norm over the whole k projection ([Hkv, hd]) repeats too: every head r times leaves its mean as it was
        k_norm = rep(lw.k_norm, 0) if lw.k_norm is not None and lw.k_norm.ndim == 2 else lw.k_norm
        return dataclasses.replace(lw, wk=rep(lw.wk, 1), wv=rep(lw.wv, 1), bk=rep(lw.bk, 0), bv=rep(lw.bv, 0),
                                   k_norm=k_norm)

    return dataclasses.replace(weights, layers=[layer(lw) for lw in weights.layers])


def duplicate_kv_heads(cfg: ModelConfig, weights: Weights, mesh: jax.sharding.Mesh,
                       rules: sharding.Rules = sharding.DEFAULT_RULES) -> tuple[ModelConfig, Weights]:
    """(config, weights) with KV heads duplicated for `mesh` (unchanged when no duplication
    applies); the repeated projections are placed with the new config's shardings, one KV head
    per device."""
    factor = kv_duplication(cfg, mesh.shape[sharding.MODEL_AXIS], rules)
    if factor == 1:
        return cfg, weights
    from jaxserve.model.weights import abstract, shardings

    new_cfg = duplicated_config(cfg, factor)
    target = shardings(abstract(new_cfg), new_cfg, mesh, rules)
    return new_cfg, jax.jit(lambda w: repeat_kv(w, factor), out_shardings=target)(weights)
