"""The weight pytree of a decoder-only transformer and its declaration.

`abstract(cfg, dtype)` is the single source of truth: it gives every leaf's shape, dtype and
logical axes. Random init, shardings and the checkpoint loader's shape checks are all derived
from it, so a new leaf is declared once.

Layout: projections are stored input-features first (`x @ w`), heads as their own axis, so the
einsum strings document the math (`"td,dhk->thk"`). The vocabulary is padded to a multiple of
`config.VOCAB_PAD` so it splits evenly over the model axis; padded logits are masked by the sampler.

Quantized weights: with `cfg.quantization` set, every projection (and the untied lm_head where the
scheme says so) is declared as a qwix `QArray` whose fields are `ParamSpec`s (values, scale, zero
point; model/quant_layout.py), so the same tree maps give their shardings, init and checks. Model code
multiplies through `model/matmul.py`, which takes either kind of leaf.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import Mesh

from jaxserve.parallel import sharding
from jaxserve.core.config import ModelConfig
from jaxserve.model.param_spec import ParamSpec, is_spec
from jaxserve.quant import host as quant_host
from jaxserve.quant.mxfp4 import BLOCK, RANDOM_BYTES, Mxfp4, padded_width


@struct.dataclass
class LayerWeights:
    attn_norm: Any          # [D]   (None: norm_placement "post")
    wq: Any                 # [D, Hq, hd]
    wk: Any                 # [D, Hkv, hd]
    wv: Any                 # [D, Hkv, hd]
    wo: Any                 # [Hq, hd, D]
    mlp_norm: Any           # [D]   (None: norm_placement "post")
    w_gate: Any             # [D, F]
    w_up: Any               # [D, F]
    w_down: Any             # [F, D]
    bq: Any = None          # [Hq, hd]  (qkv_bias)
    bk: Any = None          # [Hkv, hd]
    bv: Any = None          # [Hkv, hd]
    bo: Any = None          # [D]       (o_bias)
    q_norm: Any = None      # [hd]      (qk_norm "head"; "projection": [Hq, hd])
    k_norm: Any = None      # [hd]      ("projection": [Hkv, hd])
    post_attn_norm: Any = None  # [D]   (norm_placement "sandwich" / "post": on the attention's output)
    post_mlp_norm: Any = None   # [D]   (on the MLP's output)
    b_gate: Any = None      # [F]       (mlp_bias)
    b_up: Any = None        # [F]
    b_down: Any = None      # [D]
    # a sparse MoE block (cfg.moe, this layer) instead of the dense w_gate/w_up/w_down:
    router: Any = None      # [D, E]
    we_gate: Any = None     # [E, D, Fe]
    we_up: Any = None       # [E, D, Fe]
    we_down: Any = None     # [E, Fe, D]
    choice_bias: Any = None  # [E] float32: added to sigmoid scores to choose experts (MoEConfig.score_bias)
    router_bias: Any = None  # [E]     (MoEConfig.router_bias)
    be_gate: Any = None     # [E, Fe]  expert biases (MoEConfig.expert_biases)
    be_up: Any = None       # [E, Fe]
    be_down: Any = None     # [E, D]
    sinks: Any = None       # [Hq]     attention sinks (ModelConfig.attention_sinks)
    ws_gate: Any = None     # [D, Fs]  the shared expert (MoEConfig.shared_size)
    ws_up: Any = None       # [D, Fs]
    ws_down: Any = None     # [Fs, D]
    # multi-head latent attention (cfg.mla): wq is then q_b_proj [Rq, Hq, Dqk] after wq_a (or
    # q_proj [D, Hq, Dqk] without a q LoRA), wo [Hq, Dv, D]; wk, wv are None
    wq_a: Any = None        # [D, Rq]     q's down-projection (q_lora_rank)
    q_a_norm: Any = None    # [Rq]
    wkv_a: Any = None       # [D, L + R]  the latent and the RoPE key (kv_a_proj_with_mqa)
    kv_a_norm: Any = None   # [L]
    w_uk: Any = None        # [L, Hq, Dn] the latent's up-projection to each head's K (absorbed into q)
    w_uv: Any = None        # [L, Hq, Dv] ... and to each head's V (applied to the attention's output)
    wq_gate: Any = None     # [D, Hq, hd] the attention output's gate (cfg.attn_output_gate)
    shared_gate: Any = None  # [D]        the shared expert's gate (MoEConfig.shared_gate)
    # a Gated DeltaNet layer (cfg.linear; its kind "linear"): wq/wk/wv/wo and their norms are None
    lin_qkv: Any = None     # [D, C]      q, k, v side by side (C = 2 Hk Dk + Hv Dv: the conv's channels)
    lin_z: Any = None       # [D, Hv, Dv] the output gate
    lin_b: Any = None       # [D, Hv]     -> beta (write strength)
    lin_a: Any = None       # [D, Hv]     -> g (decay)
    lin_conv: Any = None    # [C, K]      the depthwise causal conv's taps
    lin_dt_bias: Any = None  # [Hv]
    lin_a_log: Any = None   # [Hv]
    lin_norm: Any = None    # [Dv]        the gated RMSNorm's weight (plain: x weight)
    lin_out: Any = None     # [Hv, Dv, D]


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
    dims = {"vocab": padded_vocab(cfg), "embed": cfg.hidden_size, "q_heads": cfg.num_heads,
            "kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "mlp": cfg.intermediate_size}
    if cfg.moe is not None:
        dims.update(expert=cfg.moe.num_experts, expert_mlp=cfg.moe.intermediate_size)
    return dims


def abstract(cfg: ModelConfig, dtype: Any = jnp.float32) -> Weights:
    """Weights whose leaves are `ParamSpec`s (shape, dtype, logical axes). Norms stay in dtype too."""
    d, f, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    hq, hkv, vp = cfg.num_heads, cfg.num_kv_heads, padded_vocab(cfg)

    quant = cfg.quantization

    def p(shape, axes, init="normal"):
        return ParamSpec(tuple(shape), dtype, tuple(axes), init)

    # a norm's identity weight: ones, or zeros where the norm multiplies by (1 + weight) (Gemma)
    unit = "zeros" if cfg.norm_style == "gemma" else "ones"
    pre, post = cfg.norm_placement != "post", cfg.norm_placement != "pre"

    def qk_norms() -> dict[str, ParamSpec | None]:
        if cfg.qk_norm == "projection":
            return dict(q_norm=p([hq, hd], ["q_heads", "head_dim"], unit),
                        k_norm=p([hkv, hd], ["kv_heads", "head_dim"], unit))
        if cfg.qk_norm:
            return dict(q_norm=p([hd], ["head_dim"], unit), k_norm=p([hd], ["head_dim"], unit))
        return {}

    def proj(shape, axes, contract, name, quantize=True, plain_if_untiled=False):
        """A projection: quantized under cfg.quantization, plain otherwise. plain_if_untiled: a
        checkpoint's blocks that do not tile this layout leave it plain (the loader widens it:
        checkpoints/quantized.py `widened`) instead of being an error."""
        spec = ParamSpec(tuple(shape), dtype, tuple(axes), "normal", tuple(contract))
        if quant is None or not quantize:
            return spec
        from jaxserve.model.quant_layout import declare
        try:
            return declare(spec, quant, dtype, name)
        except ValueError:
            if plain_if_untiled and quant.block is not None:
                return spec
            raise

    def layer(i: int) -> LayerWeights:
        mixer = linear_attention() if cfg.layers[i].linear else {}
        if cfg.moe is not None and cfg.moe.layers[i]:
            return dataclasses.replace(dense(), w_gate=None, w_up=None, w_down=None, b_gate=None, b_up=None,
                                       b_down=None, **experts(), **mixer)
        return dataclasses.replace(dense(), **mixer)

    def linear_attention() -> dict[str, ParamSpec | None]:
        """A Gated DeltaNet layer's leaves, its attention's set to None. Kept in the compute dtype
        and unquantized (their heads are split only by XLA)."""
        lin = cfg.linear
        hv, dv = lin.num_v_heads, lin.v_head_dim
        return dict(wq=None, wk=None, wv=None, wo=None, bq=None, bk=None, bv=None, bo=None, q_norm=None, k_norm=None,
                    wq_gate=None, sinks=None,
                    lin_qkv=p([d, lin.conv_dim], ["embed", None]), lin_z=p([d, hv, dv], ["embed", None, None]),
                    lin_b=p([d, hv], ["embed", None]), lin_a=p([d, hv], ["embed", None]),
                    lin_conv=p([lin.conv_dim, lin.conv_kernel], [None, None]),
                    lin_dt_bias=p([hv], [None], "ones"), lin_a_log=p([hv], [None]),
                    lin_norm=p([dv], [None], "ones"), lin_out=p([hv, dv, d], [None, None, "embed"]))

    def experts() -> dict[str, ParamSpec]:
        e, fe, fs = cfg.moe.num_experts, cfg.moe.intermediate_size, cfg.moe.shared_size
        # the router stays in the compute dtype (quantized checkpoints keep it so); expert stacks are
        # quantized per expert, a scale tile never straddling two experts
        leaves = dict(router=p([d, e], ["embed", None]),
                      we_gate=proj([e, d, fe], ["expert", "embed", "expert_mlp"], [1], "experts.gate_proj"),
                      we_up=proj([e, d, fe], ["expert", "embed", "expert_mlp"], [1], "experts.up_proj"),
                      we_down=proj([e, fe, d], ["expert", "expert_mlp", "embed"], [1], "experts.down_proj"))
        if cfg.moe.expert_format == "mxfp4":  # packed as published: [E, out, in / 32, 16] bytes
            def packed(out: int, inputs: int, out_axis: str | None, in_axis: str | None) -> Mxfp4:
                return Mxfp4(blocks=ParamSpec((e, out, inputs // BLOCK, BLOCK // 2), jnp.uint8,
                                              ("expert", out_axis, in_axis, None), "bytes"),
                             scales=ParamSpec((e, out, inputs // BLOCK), jnp.uint8, ("expert", out_axis, in_axis),
                                              "scale_bytes"))
            fe = padded_width(fe)
            leaves.update(we_gate=packed(fe, d, "expert_mlp", None), we_up=packed(fe, d, "expert_mlp", None),
                          we_down=packed(d, fe, None, "expert_mlp"))
        if cfg.moe.score_bias:  # float32 whatever the dtype: it breaks near-ties between experts
            leaves["choice_bias"] = ParamSpec((e,), jnp.float32, (None,), "zeros")
        if cfg.moe.router_bias:
            leaves["router_bias"] = p([e], [None], "zeros")
        if cfg.moe.expert_biases:
            leaves.update(be_gate=p([e, fe], ["expert", "expert_mlp"], "zeros"),
                          be_up=p([e, fe], ["expert", "expert_mlp"], "zeros"), be_down=p([e, d], ["expert", None], "zeros"))
        if cfg.moe.shared_gate:
            leaves["shared_gate"] = p([d], ["embed"])
        if fs:  # a dense MLP beside the experts: split like the dense MLP in every layout
            leaves.update(ws_gate=proj([d, fs], ["embed", "mlp"], [0], "shared_experts.gate_proj"),
                          ws_up=proj([d, fs], ["embed", "mlp"], [0], "shared_experts.up_proj"),
                          ws_down=proj([fs, d], ["mlp", "embed"], [0], "shared_experts.down_proj"))
        return leaves

    def latent_attention() -> dict[str, ParamSpec | None]:
        """Quantized like any projection where a scheme's tiles fit; a block format's 128-row blocks
        straddle DeepSeek's 192-row heads (q_b_proj) and end past its 576 latent rows (kv_a_proj_with_mqa):
        those stay plain, widened at load. W_uk / W_uv (kv_b_proj, split at load) are always plain: the
        absorbed form multiplies them into queries and outputs per head."""
        m = cfg.mla
        def heads(width, first, name=None):
            axes, contract = [None if first != d else "embed", "q_heads", None], [0]
            if name is None:
                return p([first, hq, width], axes)
            return proj([first, hq, width], axes, contract, name, plain_if_untiled=True)
        q = (dict(wq=heads(m.qk_head_dim, d, "q_proj")) if m.q_lora_rank is None else
             dict(wq_a=proj([d, m.q_lora_rank], ["embed", None], [0], "q_a_proj", plain_if_untiled=True),
                  q_a_norm=p([m.q_lora_rank], [None], unit), wq=heads(m.qk_head_dim, m.q_lora_rank, "q_b_proj")))
        return dict(q, wk=None, wv=None,
                    wkv_a=proj([d, m.latent_dim], ["embed", None], [0], "kv_a_proj_with_mqa", plain_if_untiled=True),
                    kv_a_norm=p([m.kv_lora_rank], [None], unit), w_uk=heads(m.qk_nope_head_dim, m.kv_lora_rank),
                    w_uv=heads(m.v_head_dim, m.kv_lora_rank),
                    wo=proj([hq, m.v_head_dim, d], ["q_heads", None, "embed"], [0, 1], "o_proj", plain_if_untiled=True))

    def dense() -> LayerWeights:
        """A layer with a dense MLP: its attention per-head K/V projections, or latent attention."""
        if cfg.mla is not None:
            return dataclasses.replace(kv_heads_layer(attention=False), **latent_attention())
        return kv_heads_layer()

    def kv_heads_layer(attention: bool = True) -> LayerWeights:
        """A layer with per-head K/V projections (attention=False: without them, for latent attention's)."""
        def attn(shape, axes, contract, name):
            return proj(shape, axes, contract, name) if attention else None
        return LayerWeights(
            attn_norm=p([d], ["embed"], unit) if pre else None,
            wq=attn([d, hq, hd], ["embed", "q_heads", "head_dim"], [0], "q_proj"),
            wk=attn([d, hkv, hd], ["embed", "kv_heads", "head_dim"], [0], "k_proj"),
            wv=attn([d, hkv, hd], ["embed", "kv_heads", "head_dim"], [0], "v_proj"),
            wo=attn([hq, hd, d], ["q_heads", "head_dim", "embed"], [0, 1], "o_proj"),
            mlp_norm=p([d], ["embed"], unit) if pre else None,
            post_attn_norm=p([d], ["embed"], unit) if post else None,
            post_mlp_norm=p([d], ["embed"], unit) if post else None,
            w_gate=proj([d, f], ["embed", "mlp"], [0], "gate_proj"),
            w_up=proj([d, f], ["embed", "mlp"], [0], "up_proj"),
            w_down=proj([f, d], ["mlp", "embed"], [0], "down_proj"),
            bq=p([hq, hd], ["q_heads", "head_dim"], "zeros") if cfg.qkv_bias else None,
            bk=p([hkv, hd], ["kv_heads", "head_dim"], "zeros") if cfg.qkv_bias else None,
            bv=p([hkv, hd], ["kv_heads", "head_dim"], "zeros") if cfg.qkv_bias else None,
            bo=p([d], ["embed"], "zeros") if cfg.o_bias else None,
            **qk_norms(),
            sinks=p([hq], ["q_heads"], "zeros") if cfg.attention_sinks else None,
            wq_gate=attn([d, hq, hd], ["embed", "q_heads", "head_dim"], [0], "q_proj") if cfg.attn_output_gate else None,
            b_gate=p([f], ["mlp"], "zeros") if cfg.mlp_bias else None,
            b_up=p([f], ["mlp"], "zeros") if cfg.mlp_bias else None,
            b_down=p([d], ["embed"], "zeros") if cfg.mlp_bias else None,
        )

    return Weights(
        embed=p([vp, d], ["vocab", "embed"]),
        layers=[layer(i) for i in range(cfg.num_layers)],
        final_norm=p([d], ["embed"], unit),
        lm_head=None if cfg.tie_word_embeddings else proj([d, vp], ["embed", "vocab"], [0], "lm_head",
                                                          quantize=quant is not None and quant.lm_head),
    )


def shardings(abstract_weights: Weights, cfg: ModelConfig, mesh: Mesh,
              rules: sharding.Rules = sharding.DEFAULT_RULES) -> Weights:
    """NamedSharding for every leaf, from its logical axes, the rules and the mesh."""
    rules = sharding.rules_for(logical_dims(cfg), mesh, rules)
    return jax.tree.map(lambda s: sharding.named(mesh, *s.axes, rules=rules, shape=s.shape), abstract_weights,
                        is_leaf=is_spec)


def abstract_arrays(cfg: ModelConfig, dtype: Any, mesh: Mesh,
                    rules: sharding.Rules = sharding.DEFAULT_RULES) -> Weights:
    """The weight pytree as ShapeDtypeStructs placed on `mesh` (no memory)."""
    specs = abstract(cfg, dtype)
    return jax.tree.map(lambda p, s: jax.ShapeDtypeStruct(p.shape, jnp.dtype(p.dtype), sharding=s), specs,
                        shardings(specs, cfg, mesh, rules), is_leaf=is_spec)


def is_quantized(leaf: Any) -> bool:
    """A quantized leaf (of arrays or of ParamSpecs): a qwix QArray, or an InputPermuted around one;
    checked without importing qwix."""
    return (hasattr(leaf, "qvalue") and hasattr(leaf, "scale")) or hasattr(leaf, "perm")


def init_random(cfg: ModelConfig, seed: int = 0, dtype: Any = jnp.float32, std: float = 0.02) -> Weights:
    """Seeded random weights (numpy, host) in the declared shapes; for tests and tiny models."""
    rng = np.random.default_rng(seed)

    def make(s: Any) -> Any:
        if is_quantized(s):  # random full-precision values, quantized as a checkpoint would be at load
            if getattr(s, "zero_point", None) is not None or hasattr(s, "perm"):
                raise ValueError("random init of a zero-point or activation-order scheme is not supported; "
                                 "load a checkpoint")
            values, scale = quant_host.quantize(make(s.qvalue), s.qtype, s.scale.shape)
            return s.replace(qvalue=values, scale=scale)
        if s.init == "ones":
            return np.ones(s.shape, np.float32)
        if s.init in RANDOM_BYTES:  # packed MXFP4 experts
            return rng.integers(*RANDOM_BYTES[s.init], s.shape)
        if s.init == "zeros":
            return np.zeros(s.shape, np.float32)
        return (rng.standard_normal(s.shape, dtype=np.float32) * std)

    specs = abstract(cfg, dtype)
    host = jax.tree.map(make, specs, is_leaf=lambda x: is_spec(x) or is_quantized(x))
    return jax.tree.map(lambda a, s: jnp.asarray(a, dtype=s.dtype), host, specs)
