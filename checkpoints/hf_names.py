"""Hugging Face tensor names -> paths in jaxserve's weight pytree, family by family.

Each entry gives the path of a leaf (`("layers", i, "wq")`) and the transform from the stored
torch Linear layout (out x in) to ours (input features first, heads as their own axis). Fused
projections (Phi-3's qkv_proj and gate_up_proj) are split into the tensors they fuse before the
table is consulted (`unfused`), so every family shares one table shape.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterator

import numpy as np

from jaxserve.core.config import ModelConfig
from jaxserve.core.hf_families import HYBRID_FAMILIES, MTP_FAMILIES, TEXT_OF_MULTIMODAL

Transform = Callable[[np.ndarray], np.ndarray]


def _heads(n: int, hd: int) -> Transform:
    """[n*hd, D] (torch Linear out x in) -> [D, n, hd]."""
    return lambda t: t.T.reshape(t.shape[1], n, hd)


# norm_placement -> HF norm module -> our LayerWeights field. Llama's "post_attention_layernorm" is
# the MLP's input norm; Gemma's and OLMo 2's is on the attention's output.
_NORMS = {
    "pre": {"input_layernorm": "attn_norm", "post_attention_layernorm": "mlp_norm"},
    "sandwich": {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attn_norm",
                 "pre_feedforward_layernorm": "mlp_norm", "post_feedforward_layernorm": "post_mlp_norm"},
    "post": {"post_attention_layernorm": "post_attn_norm", "post_feedforward_layernorm": "post_mlp_norm"},
}


def layer_tensors(cfg: ModelConfig, linear: bool = False) -> dict[str, tuple[str, Transform]]:
    """A decoder layer's HF tensor names (after `model.layers.{i}.`) -> (LayerWeights field,
    transform from the stored array). linear: a Gated DeltaNet layer's (no attention tensors)."""
    ident = lambda t: t  # noqa: E731
    transpose = lambda t: t.T  # noqa: E731
    layer = {f"{module}.weight": (field, ident) for module, field in _NORMS[cfg.norm_placement].items()}
    if linear:
        layer.update(_linear_attention_tensors(cfg))
    elif cfg.mla is not None:
        layer.update(_latent_attention_tensors(cfg))
    else:
        layer.update(_kv_heads_attention_tensors(cfg))
    layer.update({
        "mlp.gate_proj.weight": ("w_gate", transpose),
        "mlp.up_proj.weight": ("w_up", transpose),
        "mlp.down_proj.weight": ("w_down", transpose),
    })
    if cfg.mlp_bias:
        layer["mlp.gate_proj.bias"] = ("b_gate", ident)
        layer["mlp.up_proj.bias"] = ("b_up", ident)
        layer["mlp.down_proj.bias"] = ("b_down", ident)
    return layer


def _rope_halves(rows: int, rope: int, interleaved: bool) -> np.ndarray:
    """A permutation of `rows` output rows whose last `rope` are RoPE dims: DeepSeek's adjacent
    pairs (x0, x1), (x2, x3) ... reordered as halves (x0, x2, ..., x1, x3, ...), the layout
    rope.apply rotates; identity when the checkpoint is not interleaved."""
    order = np.arange(rows)
    if interleaved:
        tail = order[rows - rope:]
        order[rows - rope:] = np.concatenate([tail[0::2], tail[1::2]])
    return order


def _latent_attention_tensors(cfg: ModelConfig) -> dict[str, tuple[str, Transform]]:
    """DeepSeek-V3's MLA projections (kv_b_proj arrives split in two by `unfused`)."""
    m, hq = cfg.mla, cfg.num_heads
    per_head = _rope_halves(m.qk_head_dim, m.qk_rope_head_dim, m.rope_interleave)
    q_rows = (np.arange(hq)[:, None] * m.qk_head_dim + per_head[None, :]).reshape(-1)
    kv_rows = _rope_halves(m.latent_dim, m.qk_rope_head_dim, m.rope_interleave)
    up = lambda width: lambda t: t.reshape(hq, width, m.kv_lora_rank).transpose(2, 0, 1)  # noqa: E731  [L, H, w]
    tensors = {
        "self_attn.kv_a_proj_with_mqa.weight": ("wkv_a", lambda t: t[kv_rows].T),
        "self_attn.kv_a_layernorm.weight": ("kv_a_norm", lambda t: t),
        "self_attn.kv_b_proj.k.weight": ("w_uk", up(m.qk_nope_head_dim)),
        "self_attn.kv_b_proj.v.weight": ("w_uv", up(m.v_head_dim)),
        "self_attn.o_proj.weight": ("wo", lambda t: t.T.reshape(hq, m.v_head_dim, t.shape[0])),
    }
    if m.q_lora_rank is None:
        tensors["self_attn.q_proj.weight"] = ("wq", lambda t: _heads(hq, m.qk_head_dim)(t[q_rows]))
    else:
        tensors.update({"self_attn.q_a_proj.weight": ("wq_a", lambda t: t.T),
                        "self_attn.q_a_layernorm.weight": ("q_a_norm", lambda t: t),
                        "self_attn.q_b_proj.weight": ("wq", lambda t: _heads(hq, m.qk_head_dim)(t[q_rows]))})
    return tensors


def _linear_attention_tensors(cfg: ModelConfig) -> dict[str, tuple[str, Transform]]:
    """Gated DeltaNet's tensors as Qwen3.5 stores them (Qwen3-Next's fused in_proj_qkvz and
    in_proj_ba arrive as these by `unfused`)."""
    lin = cfg.linear
    hv, dv = lin.num_v_heads, lin.v_head_dim
    m = "linear_attn."
    return {m + "in_proj_qkv.weight": ("lin_qkv", lambda t: t.T),
            m + "in_proj_z.weight": ("lin_z", _heads(hv, dv)),
            m + "in_proj_b.weight": ("lin_b", lambda t: t.T),
            m + "in_proj_a.weight": ("lin_a", lambda t: t.T),
            m + "conv1d.weight": ("lin_conv", lambda t: t.reshape(t.shape[0], t.shape[-1])),  # [C, 1, K] -> [C, K]
            m + "dt_bias": ("lin_dt_bias", lambda t: t),
            m + "A_log": ("lin_a_log", lambda t: t),
            m + "norm.weight": ("lin_norm", lambda t: t),
            m + "out_proj.weight": ("lin_out", lambda t: t.T.reshape(hv, dv, t.shape[0]))}


def _kv_heads_attention_tensors(cfg: ModelConfig) -> dict[str, tuple[str, Transform]]:
    """Attention with per-head K and V projections."""
    hq, hkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    ident = lambda t: t  # noqa: E731
    layer = {
        "self_attn.q_proj.weight": ("wq", _heads(hq, hd)),
        "self_attn.k_proj.weight": ("wk", _heads(hkv, hd)),
        "self_attn.v_proj.weight": ("wv", _heads(hkv, hd)),
        "self_attn.o_proj.weight": ("wo", lambda t: t.T.reshape(hq, hd, t.shape[0])),
    }
    if cfg.attn_output_gate:  # q_proj holds each head's query then its gate (split by `unfused`)
        del layer["self_attn.q_proj.weight"]
        layer["self_attn.q_proj.query.weight"] = ("wq", _heads(hq, hd))
        layer["self_attn.q_proj.gate.weight"] = ("wq_gate", _heads(hq, hd))
    if cfg.qkv_bias:
        layer["self_attn.q_proj.bias"] = ("bq", lambda t: t.reshape(hq, hd))
        layer["self_attn.k_proj.bias"] = ("bk", lambda t: t.reshape(hkv, hd))
        layer["self_attn.v_proj.bias"] = ("bv", lambda t: t.reshape(hkv, hd))
    if cfg.o_bias:
        layer["self_attn.o_proj.bias"] = ("bo", ident)
    if cfg.attention_sinks:
        layer["self_attn.sinks"] = ("sinks", ident)
    if cfg.qk_norm == "projection":  # stored [H * hd], held [H, hd]
        layer["self_attn.q_norm.weight"] = ("q_norm", lambda t: t.reshape(hq, hd))
        layer["self_attn.k_norm.weight"] = ("k_norm", lambda t: t.reshape(hkv, hd))
    elif cfg.qk_norm:
        layer["self_attn.q_norm.weight"] = ("q_norm", ident)
        layer["self_attn.k_norm.weight"] = ("k_norm", ident)
    return layer


# family -> (the MoE block's module name, the expert projections gate / up / down, where the
# expert-choice bias is (after the block's name))
_MOE_NAMES = {"qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj"), None),
              "mixtral": ("block_sparse_moe", ("w1", "w3", "w2"), None),
              "glm4_moe": ("mlp", ("gate_proj", "up_proj", "down_proj"), "gate.e_score_correction_bias"),
              "deepseek_v3": ("mlp", ("gate_proj", "up_proj", "down_proj"), "gate.e_score_correction_bias"),
              "minimax_m2": ("block_sparse_moe", ("w1", "w3", "w2"), "e_score_correction_bias"),
              "qwen3_next": ("mlp", ("gate_proj", "up_proj", "down_proj"), None),
              "qwen3_5_moe": ("mlp", ("gate_proj", "up_proj", "down_proj"), None)}


def _stacked_expert_tensors(cfg: ModelConfig, prefix: str, i: int) -> dict[str, tuple[tuple[Any, ...], Callable]]:
    """gpt-oss: the experts as stacked tensors, input features first (gate_up_proj [E, D, 2F] with
    gate and up interleaved, split by `unfused`), or packed MXFP4 (`_blocks`, `_scales`: parts of
    one Mxfp4 leaf, path (..., field, part)); biased, and a biased router."""
    ident = lambda t: t  # noqa: E731
    m = f"{prefix}mlp."
    table = {m + "router.weight": (("layers", i, "router"), lambda t: t.T),
             m + "router.bias": (("layers", i, "router_bias"), ident)}
    for name, field in (("gate_proj", "we_gate"), ("up_proj", "we_up"), ("down_proj", "we_down")):
        if cfg.moe.expert_format == "mxfp4":
            for part in ("blocks", "scales"):
                table[f"{m}experts.{name}_{part}"] = (("layers", i, field, part), ident)
        else:
            table[f"{m}experts.{name}"] = (("layers", i, field), ident)
        table[f"{m}experts.{name}_bias"] = (("layers", i, "b" + field[1:]), ident)
    return table


def _moe_tensors(cfg: ModelConfig, prefix: str, i: int) -> dict[str, tuple[tuple[Any, ...], Callable]]:
    """A sparse layer's HF tensors: the router (and its choice bias, shared expert), and each
    expert's projections as one entry per expert (path ("layers", i, field, e)), stacked into the
    [E, ...] leaf by load_weights."""
    if cfg.family == "gpt_oss":
        return _stacked_expert_tensors(cfg, prefix, i)
    block, projections, bias = _MOE_NAMES[cfg.family]
    table: dict[str, tuple[tuple[Any, ...], Callable]] = {
        f"{prefix}{block}.gate.weight": (("layers", i, "router"), lambda t: t.T)}
    if cfg.moe.score_bias:
        table[f"{prefix}{block}.{bias}"] = (("layers", i, "choice_bias"), lambda t: t)
    if cfg.moe.shared_size:
        shared = "shared_expert" if cfg.moe.shared_gate else "shared_experts"  # Qwen's one, DeepSeek's several
        for name, field in zip(("gate_proj", "up_proj", "down_proj"), ("ws_gate", "ws_up", "ws_down")):
            table[f"{prefix}{block}.{shared}.{name}.weight"] = (("layers", i, field), lambda t: t.T)
    if cfg.moe.shared_gate:  # [1, D]
        table[f"{prefix}{block}.shared_expert_gate.weight"] = (("layers", i, "shared_gate"), lambda t: t[0])
    for e in range(cfg.moe.num_experts):
        for name, field in zip(projections, ("we_gate", "we_up", "we_down")):
            table[f"{prefix}{block}.experts.{e}.{name}.weight"] = (("layers", i, field, e), lambda t: t.T)
    return table


def name_table(cfg: ModelConfig) -> dict[str, tuple[tuple[Any, ...], Transform]]:
    """HF tensor name -> (path into Weights, transform from the stored array)."""
    ident = lambda t: t  # noqa: E731
    table: dict[str, tuple[tuple[Any, ...], Callable]] = {  # the vocabulary is padded as placed (_VOCAB_AXIS)
        "model.embed_tokens.weight": (("embed",), ident),
        "model.norm.weight": (("final_norm",), ident),
    }
    if not cfg.tie_word_embeddings:
        table["lm_head.weight"] = (("lm_head",), lambda t: t.T)
    kinds = {False: layer_tensors(cfg)}
    if cfg.linear is not None:
        kinds[True] = layer_tensors(cfg, linear=True)
    for i in range(cfg.num_layers):
        layer = kinds[cfg.layers[i].linear]
        p = f"model.layers.{i}."
        if cfg.moe is not None and cfg.moe.layers[i]:
            table.update(_moe_tensors(cfg, p, i))
            for suffix, (field, fn) in layer.items():
                if not suffix.startswith("mlp."):
                    table[p + suffix] = (("layers", i, field), fn)
            continue
        for suffix, (field, fn) in layer.items():
            table[p + suffix] = (("layers", i, field), fn)
    return table


def is_mtp_layer(name: str, cfg: ModelConfig) -> bool:
    """A tensor of a layer past the decoder's num_layers, in a family that stores MTP layers there."""
    if cfg.family in HYBRID_FAMILIES:  # Qwen3-Next / Qwen3.5 keep theirs under "mtp."
        return name.startswith("mtp.")
    prefix, _, rest = name.partition("model.layers.")
    index = rest.partition(".")[0]
    return cfg.family in MTP_FAMILIES and not prefix and index.isdigit() and int(index) >= cfg.num_layers


def _rows(start: int, rows: int) -> Callable[[np.ndarray], np.ndarray]:
    return lambda whole: whole[start:start + rows]


Part = tuple[str, Callable[[np.ndarray], np.ndarray]]


def _fused_parts(cfg: ModelConfig) -> dict[str, tuple[int, int, list[Part]]]:
    """A fused tensor's suffix -> (the axis it is split on, that axis's size, the tensors it holds:
    name and how to take it out)."""
    if cfg.family == "gpt_oss":  # gate and up interleaved on the output axis: last, or packed rows (1)
        width = 2 * cfg.moe.intermediate_size
        gate, up = (lambda whole: whole[..., 0::2]), (lambda whole: whole[..., 1::2])
        parts = {f"mlp.experts.gate_up_proj{s}": (-1, width, [(f"mlp.experts.gate_proj{s}", gate),
                                                              (f"mlp.experts.up_proj{s}", up)]) for s in ("", "_bias")}
        for s in ("_blocks", "_scales"):
            parts[f"mlp.experts.gate_up_proj{s}"] = (1, width, [(f"mlp.experts.gate_proj{s}", lambda w: w[:, 0::2]),
                                                                (f"mlp.experts.up_proj{s}", lambda w: w[:, 1::2])])
        return parts
    if cfg.mla is not None:  # kv_b_proj [H * (Dn + Dv), L]: each head's K rows, then its V rows
        m, hq = cfg.mla, cfg.num_heads
        width = m.qk_nope_head_dim + m.v_head_dim
        def rows(start: int, count: int) -> Callable[[np.ndarray], np.ndarray]:
            return lambda whole: whole.reshape(hq, width, -1)[:, start:start + count].reshape(hq * count, -1)
        return {"self_attn.kv_b_proj.weight": (0, hq * width, [
            ("self_attn.kv_b_proj.k.weight", rows(0, m.qk_nope_head_dim)),
            ("self_attn.kv_b_proj.v.weight", rows(m.qk_nope_head_dim, m.v_head_dim))])}
    if cfg.family in HYBRID_FAMILIES:
        return _hybrid_fused_parts(cfg)
    if cfg.family != "phi3":
        return {}
    q, kv, f = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    return {"self_attn.qkv_proj.weight": (0, q + 2 * kv, [("self_attn.q_proj.weight", _rows(0, q)),
                                                       ("self_attn.k_proj.weight", _rows(q, kv)),
                                                       ("self_attn.v_proj.weight", _rows(q + kv, kv))]),
            "mlp.gate_up_proj.weight": (0, 2 * f, [("mlp.gate_proj.weight", _rows(0, f)), ("mlp.up_proj.weight", _rows(f, f))])}


def _hybrid_fused_parts(cfg: ModelConfig) -> dict[str, tuple[int, int, list[Part]]]:
    """Gated attention's q_proj ([Hq * 2 hd, D]: per head its query rows, then its gate rows) and
    Qwen3-Next's fused Gated DeltaNet projections, grouped per key head: in_proj_qkvz rows
    [Hk, (q Dk, k Dk, v G Dv, z G Dv)] and in_proj_ba rows [Hk, (b G, a G)], G value heads per key
    head (value head h G + j belongs to key head h)."""
    hq, hd = cfg.num_heads, cfg.head_dim

    def q_part(half: int) -> Callable[[np.ndarray], np.ndarray]:
        return lambda w: w.reshape(hq, 2, hd, -1)[:, half].reshape(hq * hd, -1)

    parts: dict[str, tuple[int, int, list[Part]]] = {"self_attn.q_proj.weight": (0, 2 * hq * hd, [
        ("self_attn.q_proj.query.weight", q_part(0)), ("self_attn.q_proj.gate.weight", q_part(1))])}
    lin = cfg.linear
    if lin.projections != "qkvz":
        return parts
    hk, dk, gdv = lin.num_k_heads, lin.k_head_dim, lin.num_v_heads // lin.num_k_heads * lin.v_head_dim
    g = lin.num_v_heads // hk

    def grouped(width: int, start: int, count: int) -> Callable[[np.ndarray], np.ndarray]:
        return lambda w: w.reshape(hk, width, -1)[:, start:start + count].reshape(hk * count, -1)

    qkvz = 2 * dk + 2 * gdv
    q, k, v = grouped(qkvz, 0, dk), grouped(qkvz, dk, dk), grouped(qkvz, 2 * dk, gdv)
    parts["linear_attn.in_proj_qkvz.weight"] = (0, hk * qkvz, [
        ("linear_attn.in_proj_qkv.weight", lambda w: np.concatenate([q(w), k(w), v(w)])),
        ("linear_attn.in_proj_z.weight", grouped(qkvz, 2 * dk + gdv, gdv))])
    parts["linear_attn.in_proj_ba.weight"] = (0, 2 * lin.num_v_heads, [
        ("linear_attn.in_proj_b.weight", grouped(2 * g, 0, g)), ("linear_attn.in_proj_a.weight", grouped(2 * g, g, g))])
    return parts


# Multimodal checkpoints served as their text model: where each layout keeps the text model's
# tensors (transformers 5 saves "model.language_model.*"; the published Gemma 3 checkpoints store
# "language_model.model.*"), and the prefixes of the parts that are not read (vision tower, projector)
_TEXT_PREFIXES = {"model.language_model.": "model.", "language_model.model.": "model.",
                  "language_model.lm_head.": "lm_head."}
_NOT_TEXT = ("model.vision_tower.", "model.multi_modal_projector.", "vision_tower.", "multi_modal_projector.",
             "model.visual.")


def text_model(tensors: Iterator[tuple[str, Callable[[], np.ndarray]]], cfg: ModelConfig
               ) -> Iterator[tuple[str, Callable[[], np.ndarray]]]:
    """(name, read) per tensor of the text model, named as a *ForCausalLM checkpoint names it: a
    multimodal checkpoint's language-model tensors renamed, its other parts left out."""
    if cfg.architecture not in TEXT_OF_MULTIMODAL:
        yield from tensors
        return
    for name, read in tensors:
        old = next((p for p in _TEXT_PREFIXES if name.startswith(p)), None)
        if old is not None:
            yield _TEXT_PREFIXES[old] + name[len(old):], read
        elif not name.startswith(_NOT_TEXT):
            yield name, read


def unfused(tensors: Iterator[tuple[str, Callable[[], np.ndarray]]], cfg: ModelConfig
            ) -> Iterator[tuple[str, Callable[[], np.ndarray]]]:
    """(name, read) per tensor, a fused one given as the tensors it fuses (slices of it, taken
    when read: a memory map's slice stays a map)."""
    parts = _fused_parts(cfg)
    for name, read in tensors:
        prefix, _, suffix = name.partition(".layers.")
        index, _, module = suffix.partition(".")
        if module not in parts:
            yield name, read
            continue
        axis, size, pieces = parts[module]
        read = functools.cache(read)  # one read for all its parts (they are consumed one after another)
        for part, take in pieces:
            def read_part(read=read, take=take, name=name) -> np.ndarray:
                whole = read()
                if whole.shape[axis] != size:
                    raise ValueError(f"tensor {name!r} has shape {whole.shape}; config.json gives {size} on its "
                                     f"{'last' if axis else 'first'} axis")
                return take(whole)
            yield f"{prefix}.layers.{index}.{part}", read_part
