"""The weight pytree of a decoder-only transformer and its declaration.

`abstract(cfg, dtype)` is the single source of truth: it gives every leaf's shape, dtype and
logical axes. Random init, shardings and the checkpoint loader's shape checks are all derived
from it, so a new leaf is declared once.

Layout: projections are stored input-features first (`x @ w`), heads as their own axis, so the
einsum strings document the math (`"td,dhk->thk"`). The vocabulary is padded to a multiple of
`config.VOCAB_PAD` so it splits evenly over the model axis; padded logits are masked by the sampler.

A leaf may later become a (values, scales) pair for quantized weights: the projections in
model/transformer.py (`qkv`, `mlp`, the output projection, `lm_head`) are the places that would
learn to dequantize.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import Mesh

from jaxserve import sharding
from jaxserve.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    shape: tuple[int, ...]
    dtype: Any
    axes: tuple[str | None, ...]  # logical axis names, one per dim
    init: str = "normal"          # "normal" | "ones" | "zeros"


@struct.dataclass
class LayerWeights:
    attn_norm: Any          # [D]
    wq: Any                 # [D, Hq, hd]
    wk: Any                 # [D, Hkv, hd]
    wv: Any                 # [D, Hkv, hd]
    wo: Any                 # [Hq, hd, D]
    mlp_norm: Any           # [D]
    w_gate: Any             # [D, F]
    w_up: Any               # [D, F]
    w_down: Any             # [F, D]
    bq: Any = None          # [Hq, hd]  (qkv_bias)
    bk: Any = None          # [Hkv, hd]
    bv: Any = None          # [Hkv, hd]
    bo: Any = None          # [D]       (o_bias)
    q_norm: Any = None      # [hd]      (qk_norm)
    k_norm: Any = None      # [hd]
    b_gate: Any = None      # [F]       (mlp_bias)
    b_up: Any = None        # [F]
    b_down: Any = None      # [D]


@struct.dataclass
class Weights:
    embed: Any                  # [Vp, D]
    layers: list[LayerWeights]
    final_norm: Any             # [D]
    lm_head: Any = None         # [D, Vp]; None when tied to embed


def padded_vocab(cfg: ModelConfig) -> int:
    return cfg.padded_vocab_size


def logical_dims(cfg: ModelConfig) -> dict[str, int]:
    """Size of every logical axis, for `sharding.rules_for`."""
    return {"vocab": padded_vocab(cfg), "embed": cfg.hidden_size, "q_heads": cfg.num_heads,
            "kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "mlp": cfg.intermediate_size}


def abstract(cfg: ModelConfig, dtype: Any = jnp.float32) -> Weights:
    """Weights whose leaves are `ParamSpec`s (shape, dtype, logical axes). Norms stay in dtype too."""
    d, f, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    hq, hkv, vp = cfg.num_heads, cfg.num_kv_heads, padded_vocab(cfg)

    def p(shape, axes, init="normal"):
        return ParamSpec(tuple(shape), dtype, tuple(axes), init)

    def layer() -> LayerWeights:
        return LayerWeights(
            attn_norm=p([d], ["embed"], "ones"),
            wq=p([d, hq, hd], ["embed", "q_heads", "head_dim"]),
            wk=p([d, hkv, hd], ["embed", "kv_heads", "head_dim"]),
            wv=p([d, hkv, hd], ["embed", "kv_heads", "head_dim"]),
            wo=p([hq, hd, d], ["q_heads", "head_dim", "embed"]),
            mlp_norm=p([d], ["embed"], "ones"),
            w_gate=p([d, f], ["embed", "mlp"]),
            w_up=p([d, f], ["embed", "mlp"]),
            w_down=p([f, d], ["mlp", "embed"]),
            bq=p([hq, hd], ["q_heads", "head_dim"], "zeros") if cfg.qkv_bias else None,
            bk=p([hkv, hd], ["kv_heads", "head_dim"], "zeros") if cfg.qkv_bias else None,
            bv=p([hkv, hd], ["kv_heads", "head_dim"], "zeros") if cfg.qkv_bias else None,
            bo=p([d], ["embed"], "zeros") if cfg.o_bias else None,
            q_norm=p([hd], ["head_dim"], "ones") if cfg.qk_norm else None,
            k_norm=p([hd], ["head_dim"], "ones") if cfg.qk_norm else None,
            b_gate=p([f], ["mlp"], "zeros") if cfg.mlp_bias else None,
            b_up=p([f], ["mlp"], "zeros") if cfg.mlp_bias else None,
            b_down=p([d], ["embed"], "zeros") if cfg.mlp_bias else None,
        )

    return Weights(
        embed=p([vp, d], ["vocab", "embed"]),
        layers=[layer() for _ in range(cfg.num_layers)],
        final_norm=p([d], ["embed"], "ones"),
        lm_head=None if cfg.tie_word_embeddings else p([d, vp], ["embed", "vocab"]),
    )


def _is_spec(x: Any) -> bool:
    return isinstance(x, ParamSpec)


def shardings(abstract_weights: Weights, cfg: ModelConfig, mesh: Mesh,
              rules: sharding.Rules = sharding.DEFAULT_RULES) -> Weights:
    """NamedSharding for every leaf, from its logical axes, the rules and the mesh."""
    rules = sharding.rules_for(logical_dims(cfg), mesh, rules)
    return jax.tree.map(lambda s: sharding.named(mesh, *s.axes, rules=rules), abstract_weights, is_leaf=_is_spec)


def init_random(cfg: ModelConfig, seed: int = 0, dtype: Any = jnp.float32, std: float = 0.02) -> Weights:
    """Seeded random weights (numpy, host) in the declared shapes; for tests and tiny models."""
    rng = np.random.default_rng(seed)

    def make(s: ParamSpec) -> np.ndarray:
        if s.init == "ones":
            return np.ones(s.shape, np.float32)
        if s.init == "zeros":
            return np.zeros(s.shape, np.float32)
        return (rng.standard_normal(s.shape, dtype=np.float32) * std)

    host = jax.tree.map(make, abstract(cfg, dtype), is_leaf=_is_spec)
    return jax.tree.map(lambda a: jnp.asarray(a, dtype=dtype), host)
