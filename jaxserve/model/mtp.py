"""A checkpoint's multi-token-prediction (MTP) layer as a draft head: its configuration, weights and
forward, as pure functions (DeepSeek-V3 / Kimi K2 and GLM-4.5 ship one after their decoder layers).

For a token row at position p the head reads the target's residual stream after its last layer at
p (h, [D]) and the embedding of the token at p + 1, and predicts the token at p + 2:

    x   = eh_proj([enorm(embed(x_{p+1})) ; hnorm(h)])   [2D] -> [D]  (the embedding zeroed at
                                                                      position 0, as vLLM serves it)
    out = decoder_layer(x)                               one layer of the target's own kind (MLA or
                                                         per-head K/V attention, MoE or dense MLP)
    logits = lm_head(norm(out))                          the target's embeddings and lm_head, shared

Further drafts feed `out` back as h (the one layer predicts p + 3, p + 4, ...). The head keeps K/V
(or latent rows) of its layer per position in its own pool, paged with the target's tables. It
plugs into the EAGLE-3 head's runner (runner/proposers/hidden_heads.py): the same fill / propose cycle,
the same signatures (`forward`, `draft_ids`, `abstract`, `logical_dims`)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from jaxserve.core.config import ModelConfig
from jaxserve.core.hf_families import MTP_FAMILIES
from jaxserve.model import weights as W
from jaxserve.model.matmul import einsum
from jaxserve.model.norms import rms_norm
from jaxserve.model.param_spec import ParamSpec
from jaxserve.model.transformer import Attend, decoder_layer, lm_head, norm, rotary_tables


@dataclasses.dataclass(frozen=True)
class MtpConfig:
    layer: ModelConfig          # the MTP layer as a one-layer model of the target's kind
    target_layers: int          # the target's num_layers: the head reads the stream after the last

    @property
    def hidden_size(self) -> int:
        return self.layer.hidden_size

    @property
    def aux_layers(self) -> tuple[int, ...]:
        return (self.target_layers,)

    @classmethod
    def of(cls, target: ModelConfig) -> "MtpConfig":
        """The head of `target`'s family: its layer is the target's last layer kind, sparse when the
        target's MLPs are (DeepSeek's and GLM's MTP layers are MoE layers)."""
        if target.family not in MTP_FAMILIES:
            raise ValueError(f"--speculative-config method 'mtp' needs a checkpoint with MTP layers "
                             f"({', '.join(MTP_FAMILIES)}); {target.architecture} has none")
        moe = None if target.moe is None else dataclasses.replace(target.moe, layers=(True,))
        # held in the compute dtype whatever the target's quantization (an fp8 checkpoint's MTP layer is widened at
        # load: checkpoints/mtp.py): one layer
        layer = dataclasses.replace(target, num_layers=1, layers=target.layers[-1:], moe=moe, single_kv_group=True,
                                    quantization=None)
        return cls(layer=layer, target_layers=target.num_layers)


@struct.dataclass
class MtpWeights:
    enorm: Any              # [D]   the next token's embedding norm
    hnorm: Any              # [D]   the target hidden state's norm
    eh_proj: Any            # [2D, D]
    layer: W.LayerWeights   # one decoder layer of the target's kind
    final_norm: Any         # [D]   shared_head.norm


def abstract(cfg: MtpConfig, dtype: Any = jnp.float32) -> MtpWeights:
    """Every leaf as a ParamSpec: the layer declared as the target's layers are (model/weights.py)."""
    d = cfg.hidden_size
    unit = "zeros" if cfg.layer.norm_style == "gemma" else "ones"
    return MtpWeights(enorm=ParamSpec((d,), dtype, ("embed",), unit), hnorm=ParamSpec((d,), dtype, ("embed",), unit),
                      eh_proj=ParamSpec((2 * d, d), dtype, (None, "embed"), "normal", (0,)),
                      layer=W.abstract(cfg.layer, dtype).layers[0],
                      final_norm=ParamSpec((d,), dtype, ("embed",), unit))


def logical_dims(cfg: MtpConfig) -> dict[str, int]:
    return W.logical_dims(cfg.layer)


def forward(w: MtpWeights, cfg: MtpConfig, embed: jax.Array, tokens: jax.Array, positions: jax.Array,
            hidden: jax.Array, attend: Attend, cache: Any, rows: jax.Array, *, combine: bool
            ) -> tuple[jax.Array, Any]:
    """One head forward over a flat batch of token rows (eagle3.forward's contract): tokens[i] is
    the token after row i's position, hidden [T, D] the target's last residual (combine) or the
    head's previous outputs. Returns (the outputs of `rows` [R, D], the updated cache)."""
    del combine  # both inputs are [T, D] residual streams
    c = cfg.layer
    e = jnp.take(embed, tokens, axis=0).astype(hidden.dtype)
    e = jnp.where((positions == 0)[:, None], jnp.zeros_like(e), e)
    x = jnp.concatenate([rms_norm(e, w.enorm, c.rms_norm_eps), rms_norm(hidden, w.hnorm, c.rms_norm_eps)], axis=-1)
    x = einsum("...i,id->...d", x, w.eh_proj)
    out, cache = decoder_layer(c, 0, w.layer, x, rotary_tables(c, positions), attend, cache)
    return jnp.take(out, rows, axis=0), cache


def draft_ids(w: MtpWeights, cfg: MtpConfig, out: jax.Array, target: W.Weights) -> jax.Array:
    """Outputs [R, D] -> greedy drafts [R] int32, through the target's lm_head."""
    logits = lm_head(target, norm(cfg.layer, out, w.final_norm))[:, :cfg.layer.vocab_size]
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
