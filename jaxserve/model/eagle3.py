"""The EAGLE-3 draft head: its configuration, its weight pytree and its forward, as pure functions.

EAGLE-3 (Li et al. 2025) proposes from the target's own hidden states. For a token row at position p
it reads the target's residual stream entering a few chosen layers (`aux_layers`, concatenated in
layer order: [3 * Dt]) and the embedding of the token at p + 1, and predicts the token at p + 2:

    h   = fc(aux)                          [D]   (the first draft step; later steps pass the head's
                                                  own pre-norm output instead, already [D])
    x   = [rms(embed(x_{p+1})) ; rms_h(h)] [2D]  one decoder layer whose q/k/v read 2D features
    h'  = h + o(attn(x))                         (h normed first when norm_before_residual)
    out = h' + mlp(rms(h'))                      the pre-norm output, fed to the next draft step
    logits = lm_head(rms(out))             [Vd]  a draft vocabulary; d2t maps its ids to the target's

The head keeps K/V of its one layer per position like any model (paged, in the target's pages).
Configuration and tensors follow the Hugging Face layout the EAGLE authors publish
(checkpoints/eagle3.py reads them).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from jaxserve.core.config import VOCAB_PAD, ModelConfig
from jaxserve.model import rope
from jaxserve.model.matmul import einsum
from jaxserve.model.param_spec import ParamSpec
from jaxserve.model.norms import rms_norm
from jaxserve.model.transformer import Attend, mlp, qkv
from jaxserve.model.weights import LayerWeights

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
NUM_AUX_LAYERS = 3


@dataclasses.dataclass(frozen=True)
class Eagle3Config:
    layer: ModelConfig              # the decoder layer (num_layers 1; q/k/v read 2 * hidden_size features)
    target_hidden_size: int         # Dt: fc reads len(aux_layers) * Dt features
    draft_vocab_size: int           # Vd (d2t maps draft ids to target ids)
    aux_layers: tuple[int, ...]     # target layers whose input residual the head reads, ascending
    norm_before_residual: bool = False
    has_embed: bool = False         # the checkpoint has its own embed_tokens (else the target's)
    has_d2t: bool = False           # a draft vocabulary smaller than the target's, mapped by d2t

    @property
    def hidden_size(self) -> int:
        return self.layer.hidden_size

    @property
    def padded_draft_vocab(self) -> int:
        return -(-self.draft_vocab_size // VOCAB_PAD) * VOCAB_PAD

    @classmethod
    def from_hf(cls, raw: dict[str, Any], target: ModelConfig, tensors: set[str]) -> "Eagle3Config":
        """From the head's config.json and its tensor names, checked against the target;
        ValueError names the field that does not fit."""
        archs = raw.get("architectures") or []
        if not any(a in ARCHITECTURES for a in archs):
            raise ValueError(f"--speculative-config eagle3 model has architectures {archs}; an EAGLE-3 head "
                             f"declares one of {', '.join(ARCHITECTURES)}")
        layer = ModelConfig.from_hf({**raw, "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1})
        if layer.vocab_size != target.vocab_size:
            raise ValueError(f"EAGLE-3 head has vocab_size {layer.vocab_size}, the target {target.vocab_size}: "
                             "a head must be trained for the target's tokenizer")
        target_hidden = int(raw.get("target_hidden_size") or target.hidden_size)
        if target_hidden != target.hidden_size:
            raise ValueError(f"EAGLE-3 head reads target hidden states of size {target_hidden}, the target's "
                             f"are {target.hidden_size}")
        ids = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        n = target.num_layers
        # vLLM's default when the config names none: early, middle and late layers.
        ids = list(ids) if ids is not None else [2, n // 2, n - 3]
        aux = tuple(sorted(set(ids)))
        if len(aux) != NUM_AUX_LAYERS or any(not 0 <= i < n for i in aux):
            raise ValueError(f"EAGLE-3 head reads target layers {ids}; it needs "
                             f"{NUM_AUX_LAYERS} distinct layers of the target's {n} (set "
                             "eagle_config.eagle_aux_hidden_state_layer_ids in the head's config.json)")
        draft_vocab = int(raw.get("draft_vocab_size") or layer.vocab_size)
        has_d2t = "d2t" in tensors
        if draft_vocab != layer.vocab_size and not has_d2t:
            raise ValueError(f"EAGLE-3 head has draft_vocab_size {draft_vocab} < vocab_size {layer.vocab_size} "
                             "but no d2t tensor mapping its ids to the target's")
        return cls(layer=layer, target_hidden_size=target_hidden, draft_vocab_size=draft_vocab, aux_layers=aux,
                   norm_before_residual=bool(raw.get("norm_before_residual", False)),
                   has_embed=any(t.endswith("embed_tokens.weight") for t in tensors), has_d2t=has_d2t)


@struct.dataclass
class Eagle3Weights:
    fc: Any                 # [3 * Dt, D]
    hidden_norm: Any        # [D]
    layer: LayerWeights     # attn_norm: the embeddings' norm; wq/wk/wv read [2D]; mlp_norm: post-attention
    final_norm: Any         # [D]
    lm_head: Any            # [D, Vdp] draft vocabulary, padded
    d2t: Any                # [Vdp] int32 target id of each draft id (identity without a draft vocabulary)
    embed: Any = None       # [Vp, D] the head's own embeddings, or None: the target's


def abstract(cfg: Eagle3Config, dtype: Any = jnp.float32) -> Eagle3Weights:
    """Every leaf as a ParamSpec (shape, dtype, logical axes), as model/weights.abstract declares the
    target's: shardings and shape checks derive from it."""
    c = cfg.layer
    d, f, hd, hq, hkv = c.hidden_size, c.intermediate_size, c.head_dim, c.num_heads, c.num_kv_heads

    def p(shape, axes, init="normal", dt=dtype):
        return ParamSpec(tuple(shape), dt, tuple(axes), init)

    def proj(shape, axes, contract):
        return ParamSpec(tuple(shape), dtype, tuple(axes), "normal", tuple(contract))

    bias = lambda shape, axes, on: p(shape, axes, "zeros") if on else None  # noqa: E731
    layer = LayerWeights(
        attn_norm=p([d], ["embed"], "ones"),
        wq=proj([2 * d, hq, hd], [None, "q_heads", "head_dim"], [0]),
        wk=proj([2 * d, hkv, hd], [None, "kv_heads", "head_dim"], [0]),
        wv=proj([2 * d, hkv, hd], [None, "kv_heads", "head_dim"], [0]),
        wo=proj([hq, hd, d], ["q_heads", "head_dim", "embed"], [0, 1]),
        mlp_norm=p([d], ["embed"], "ones"),
        w_gate=proj([d, f], ["embed", "mlp"], [0]),
        w_up=proj([d, f], ["embed", "mlp"], [0]),
        w_down=proj([f, d], ["mlp", "embed"], [0]),
        bq=bias([hq, hd], ["q_heads", "head_dim"], c.qkv_bias), bk=bias([hkv, hd], ["kv_heads", "head_dim"], c.qkv_bias),
        bv=bias([hkv, hd], ["kv_heads", "head_dim"], c.qkv_bias), bo=bias([d], ["embed"], c.o_bias),
        b_gate=bias([f], ["mlp"], c.mlp_bias), b_up=bias([f], ["mlp"], c.mlp_bias), b_down=bias([d], ["embed"], c.mlp_bias))
    vdp = cfg.padded_draft_vocab
    return Eagle3Weights(
        fc=proj([NUM_AUX_LAYERS * cfg.target_hidden_size, d], [None, "embed"], [0]),
        hidden_norm=p([d], ["embed"], "ones"), layer=layer, final_norm=p([d], ["embed"], "ones"),
        lm_head=proj([d, vdp], ["embed", "draft_vocab"], [0]),
        d2t=p([vdp], [None], "zeros", jnp.int32),
        embed=p([c.padded_vocab_size, d], ["vocab", "embed"]) if cfg.has_embed else None)


def logical_dims(cfg: Eagle3Config) -> dict[str, int]:
    c = cfg.layer
    return {"vocab": c.padded_vocab_size, "draft_vocab": cfg.padded_draft_vocab, "embed": c.hidden_size,
            "q_heads": c.num_heads, "kv_heads": c.num_kv_heads, "head_dim": c.head_dim, "mlp": c.intermediate_size}


def forward(w: Eagle3Weights, cfg: Eagle3Config, embed: jax.Array, tokens: jax.Array, positions: jax.Array,
            hidden: jax.Array, attend: Attend, cache: Any, rows: jax.Array, *, combine: bool
            ) -> tuple[jax.Array, Any]:
    """One draft forward over a flat batch of token rows.

    embed: [Vp, D] the embedding table (the head's or the target's); tokens, positions: [T] int32
    (tokens[i] is the token *after* row i's position); hidden: [T, 3 Dt] the target's aux states
    (combine=True) or [T, D] the head's previous pre-norm outputs; rows: [R] the rows to keep.
    Returns (the pre-norm outputs of those rows [R, D], the updated cache); `draft_ids` turns
    outputs into drafts."""
    c = cfg.layer
    h = einsum("...i,id->...d", hidden.astype(w.fc.dtype), w.fc) if combine else hidden
    h_normed = rms_norm(h, w.hidden_norm, c.rms_norm_eps)
    residual = h_normed if cfg.norm_before_residual else h
    e = rms_norm(jnp.take(embed, tokens, axis=0).astype(h.dtype), w.layer.attn_norm, c.rms_norm_eps)
    x = jnp.concatenate([e, h_normed], axis=-1)                                    # [T, 2D]
    q, k, v = qkv(w.layer, x, rope.cos_sin(c, positions), c)
    out, cache = attend(0, q, k, v, cache)
    out = out.astype(h.dtype)
    o = einsum("...hk,hkd->...d", out, w.layer.wo)
    h = residual + (o if w.layer.bo is None else o + w.layer.bo)
    h = h + mlp(w.layer, rms_norm(h, w.layer.mlp_norm, c.rms_norm_eps))           # pre-norm output [T, D]
    return jnp.take(h, rows, axis=0), cache


def draft_ids(w: Eagle3Weights, cfg: Eagle3Config, out: jax.Array, target: Any = None) -> jax.Array:
    """Pre-norm outputs [R, D] -> the greedy drafts as target ids [R] int32 (through d2t; the head
    has its own lm_head: `target`, the target's weights, is not read)."""
    logits = einsum("...d,dv->...v", rms_norm(out, w.final_norm, cfg.layer.rms_norm_eps), w.lm_head,
                    preferred_element_type=jnp.float32)[:, :cfg.draft_vocab_size]
    return w.d2t[jnp.argmax(logits, axis=-1).astype(jnp.int32)]
