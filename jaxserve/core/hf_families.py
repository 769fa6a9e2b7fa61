"""A Hugging Face `config.json` read into a `ModelConfig`, family by family.

A family fixes the parts a config does not spell out (Qwen2's q/k/v biases, Gemma's sandwich norms
and scaled embeddings, OLMo 2's norms after each block); the config gives the rest, per layer where
it varies (`layer_types`, `sliding_window`, `no_rope_layers`, per-layer-type `rope_parameters`).
Anything that cannot be served faithfully raises a ValueError naming the field.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxserve.core.hf_fields import positive_int as _positive_int, require as _require
from jaxserve.core.hf_mixers import mla_scale, parse_linear, parse_mla
from jaxserve.core.layer_kinds import LayerKind, MoEConfig, RopeConfig

_DTYPE_NAMES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16",
                "fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16",
                "float": "float32"}


def normalize_dtype_name(name: str) -> str:
    """'bf16', 'torch.bfloat16', 'half', ... -> 'float32' | 'bfloat16' | 'float16'."""
    key = str(name).replace("torch.", "")
    if key not in _DTYPE_NAMES:
        raise ValueError(f"unsupported dtype {name!r}; use float32, bfloat16 or float16")
    return _DTYPE_NAMES[key]


@dataclasses.dataclass(frozen=True)
class Family:
    """What a family's modeling code fixes, whatever its config says."""
    qkv_bias: bool | None = None    # None: config.json's attention_bias decides
    o_bias: bool | None = None
    qk_norm: str = ""               # "" | "head" | "projection" (ModelConfig.qk_norm)
    norm_placement: str = "pre"     # "pre" | "sandwich" | "post"
    norm_style: str = "llama"       # "llama" | "float32" | "gemma"
    gemma_scaling: bool = False     # embeddings x sqrt(hidden), query_pre_attn_scalar, soft-caps
    window_every_layer: bool = False  # one sliding_window for every layer (Mistral, Mixtral, Phi-3)
    window_pattern: int = 0         # configs without layer_types: layer i slides unless (i + 1) % pattern == 0


FAMILIES = {
    "llama": Family(),
    "mistral": Family(window_every_layer=True),
    "qwen2": Family(qkv_bias=True, o_bias=False),
    "qwen3": Family(qk_norm="head"),
    "qwen3_moe": Family(qk_norm="head"),
    "mixtral": Family(window_every_layer=True),
    "gemma2": Family(o_bias=False, norm_placement="sandwich", norm_style="gemma", gemma_scaling=True,
                     window_pattern=2),
    "gemma3": Family(o_bias=False, qk_norm="head", norm_placement="sandwich", norm_style="gemma",
                     gemma_scaling=True, window_pattern=6),
    "olmo2": Family(qk_norm="projection", norm_placement="post", norm_style="float32"),
    "smollm3": Family(),
    "phi3": Family(qkv_bias=False, o_bias=False, window_every_layer=True),
    "glm4_moe": Family(o_bias=False),
    "minimax_m2": Family(qk_norm="projection"),
    "gpt_oss": Family(),
    "deepseek_v3": Family(qkv_bias=False, o_bias=False),
    # hybrids: Gated DeltaNet layers beside gated full attention, every norm x (1 + weight)
    "qwen3_next": Family(qkv_bias=False, o_bias=False, qk_norm="head", norm_style="gemma"),
    "qwen3_5": Family(qkv_bias=False, o_bias=False, qk_norm="head", norm_style="gemma"),
    "qwen3_5_moe": Family(qkv_bias=False, o_bias=False, qk_norm="head", norm_style="gemma"),
}
# families whose linear-attention layers are Gated DeltaNet (layer_types "linear_attention")
HYBRID_FAMILIES = ("qwen3_next", "qwen3_5", "qwen3_5_moe")
# architecture name -> family
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Gemma3ForConditionalGeneration": "gemma3",  # its text model: the vision tower is not read
    "Olmo2ForCausalLM": "olmo2",
    "SmolLM3ForCausalLM": "smollm3",
    "Phi3ForCausalLM": "phi3",
    "Glm4MoeForCausalLM": "glm4_moe",
    "MiniMaxM2ForCausalLM": "minimax_m2",
    "GptOssForCausalLM": "gpt_oss",
    "DeepseekV3ForCausalLM": "deepseek_v3",  # and Kimi K2, which ships this architecture
    "Qwen3NextForCausalLM": "qwen3_next",
    "Qwen3_5ForCausalLM": "qwen3_5",
    "Qwen3_5MoeForCausalLM": "qwen3_5_moe",
    "Qwen3_5ForConditionalGeneration": "qwen3_5",  # their text models: the vision encoder is not read
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe",
}
# families whose checkpoints store multi-token-prediction layers after the decoder's (as layers
# num_hidden_layers ...): the decoder does not read them; speculative method "mtp" does (model/mtp.py)
MTP_FAMILIES = ("glm4_moe", "deepseek_v3")
_MODEL_TYPES = {"gemma3_text": "Gemma3ForCausalLM", "qwen3_5_text": "Qwen3_5ForCausalLM",
                "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM"}  # model_type -> architecture, where not the family name
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh"}
# fields whose meaning we do not serve: named in the refusal
_REFUSED = {"use_bidirectional_attention": "bidirectional attention", "attention_chunk_size": "chunked attention"}


def _parse_rope(params: dict, cfg: dict, max_pos: int, where: str = "rope_parameters") -> RopeConfig:
    """One RoPE from its parameters (transformers 5's rope_parameters, or a legacy rope_scaling
    merged in), with the config's top-level rope_theta / partial_rotary_factor as fallbacks."""
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported RoPE type '{rope_type}' in config.json ({where}.rope_type); "
                         f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    fraction = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    if fraction is None:  # MiniMax-M2's released configs give the rotated dims instead
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        fraction = cfg["rotary_dim"] / head_dim if cfg.get("rotary_dim") else 1.0
    if not 0 < fraction <= 1:
        raise ValueError(f"config.json field 'partial_rotary_factor' must be in (0, 1], got {fraction!r}")
    factor = params.get("factor", 1.0)
    if rope_type not in ("default", "yarn") and (factor is None or factor <= 0):
        raise ValueError(f"RoPE type '{rope_type}' needs a positive 'factor', got {factor!r}")
    original = params.get("original_max_position_embeddings")
    if rope_type == "llama3" and original is None:
        raise ValueError("RoPE type 'llama3' needs 'original_max_position_embeddings'")
    if rope_type == "yarn":
        if original is None:
            original = max_pos
        if factor is None:
            factor = max_pos / original
    return RopeConfig(
        rope_type=rope_type, theta=float(theta), factor=float(factor if factor is not None else 1.0),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=original,
        beta_fast=float(params.get("beta_fast") or 32.0), beta_slow=float(params.get("beta_slow") or 1.0),
        mscale=params.get("mscale"), mscale_all_dim=params.get("mscale_all_dim"),
        attention_factor=params.get("attention_factor"), truncate=bool(params.get("truncate", True)),
        partial_rotary_factor=float(fraction),
    )


def _ropes_by_layer_type(cfg: dict, max_pos: int) -> dict[str, RopeConfig]:
    """layer type -> its RoPE: one for all ("*"), or one per type where rope_parameters is keyed by
    layer type (Gemma 3: a local base for sliding layers, a scaled global one for full ones)."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        return {kind: _parse_rope(p, cfg, max_pos, f"rope_parameters.{kind}") for kind, p in params.items()}
    params = dict(params or {})
    for key, value in (cfg.get("rope_scaling") or {}).items():
        params.setdefault(key, value)
    ropes = {"*": _parse_rope(params, cfg, max_pos)}
    if cfg.get("rope_local_base_freq") is not None:  # older Gemma 3 configs: the sliding layers' base
        ropes["sliding_attention"] = _parse_rope({"rope_theta": cfg["rope_local_base_freq"]}, cfg, max_pos)
    return ropes


def _layer_types(cfg: dict, family: str, num_layers: int) -> list[str]:
    """Each layer's attention type: 'full_attention' or 'sliding_attention'."""
    window = cfg.get("sliding_window")
    layer_types = cfg.get("layer_types")
    if layer_types is not None:
        if len(layer_types) != num_layers:
            raise ValueError(f"config.json field 'layer_types' has {len(layer_types)} entries for "
                             f"{num_layers} layers")
        served = {"full_attention", "sliding_attention"} | ({"linear_attention"} if family in HYBRID_FAMILIES else set())
        unknown = set(layer_types) - served
        if unknown:
            raise ValueError(f"config.json field 'layer_types' has unsupported entries {sorted(unknown)}")
        if "sliding_attention" in layer_types and not window:
            raise ValueError("config.json has sliding_attention layers but no 'sliding_window'")
        if family == "smollm3" and not cfg.get("use_sliding_window"):
            return ["full_attention"] * num_layers  # SmolLM3 reads layer_types only with the flag on
        return list(layer_types)
    if family in HYBRID_FAMILIES:  # older configs: every full_attention_interval-th layer attends
        interval = cfg.get("full_attention_interval") or 4
        return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)]
    if FAMILIES[family].window_pattern and window:
        pattern = (cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern")
                   or FAMILIES[family].window_pattern)
        return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
    if FAMILIES[family].window_every_layer:
        return ["sliding_attention" if window else "full_attention"] * num_layers
    if cfg.get("use_sliding_window") and window:
        # Older Qwen2 configs: layers from max_window_layers on use the window.
        first = cfg.get("max_window_layers", num_layers)
        return ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    return ["full_attention"] * num_layers


def _layer_kinds(cfg: dict, family: str, num_layers: int, max_pos: int) -> tuple[LayerKind, ...]:
    ropes = _ropes_by_layer_type(cfg, max_pos)
    window = cfg.get("sliding_window")
    uses_rope = cfg.get("no_rope_layers") if family == "smollm3" else None  # 1: RoPE, 0: none (NoPE)
    if uses_rope is not None and len(uses_rope) != num_layers:
        raise ValueError(f"config.json field 'no_rope_layers' has {len(uses_rope)} entries for {num_layers} layers")
    kinds = []
    for i, kind in enumerate(_layer_types(cfg, family, num_layers)):
        if kind == "linear_attention":
            kinds.append(LayerKind(rope=None, mixer="linear"))
            continue
        if kind not in ropes and "*" not in ropes:
            raise ValueError(f"config.json field 'rope_parameters' has no entry for layer type '{kind}'")
        rope = ropes.get(kind, ropes.get("*"))
        kinds.append(LayerKind(window=window if kind == "sliding_attention" else None,
                               rope=rope if uses_rope is None or uses_rope[i] else None))
    return tuple(kinds)


def _parse_moe(cfg: dict, family: str, num_layers: int) -> MoEConfig | None:
    """The MoE fields of a sparse family's config.json (None for dense families)."""
    routing: dict[str, Any] = {}  # MoEConfig's fields beyond the softmax defaults
    if family == "mixtral":
        experts, width, renormalize = _positive_int(cfg, "num_local_experts"), _positive_int(cfg, "intermediate_size"), True
        layers = (True,) * num_layers
    elif family in ("qwen3_moe", "qwen3_next", "qwen3_5_moe"):
        if family != "qwen3_moe" and not cfg.get("num_experts"):
            return None  # a dense Qwen3-Next
        key = "num_experts" if cfg.get("num_experts") is not None else "num_local_experts"
        experts, width = _positive_int(cfg, key), _positive_int(cfg, "moe_intermediate_size")
        # Qwen3.5-MoE always renormalises (its config has no norm_topk_prob)
        renormalize = family == "qwen3_5_moe" or bool(cfg.get("norm_topk_prob", family == "qwen3_next"))
        step, dense = cfg.get("decoder_sparse_step", 1) or 1, set(cfg.get("mlp_only_layers") or ())
        layers = tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))
        if family != "qwen3_moe" and cfg.get("shared_expert_intermediate_size"):
            routing = dict(shared_size=_positive_int(cfg, "shared_expert_intermediate_size"), shared_gate=True)
    elif family in ("glm4_moe", "deepseek_v3"):  # DeepSeek's noaux_tc routing, which GLM-4.5 took over
        for key, served in (("topk_method", "noaux_tc"), ("scoring_func", "sigmoid"), ("moe_layer_freq", 1)):
            if cfg.get(key, served) != served:
                raise ValueError(f"config.json field '{key}' is {cfg[key]!r}; only {served!r} is served")
        experts, width = _positive_int(cfg, "n_routed_experts"), _positive_int(cfg, "moe_intermediate_size")
        renormalize = bool(cfg.get("norm_topk_prob", True))
        kinds = cfg.get("mlp_layer_types")  # newer configs: "dense" / "sparse" per layer
        if kinds is not None and (len(kinds) != num_layers or set(kinds) - {"dense", "sparse"}):
            raise ValueError(f"config.json field 'mlp_layer_types' must give 'dense' or 'sparse' for each of the "
                             f"{num_layers} layers, got {kinds!r}")
        layers = (tuple(k == "sparse" for k in kinds) if kinds is not None
                  else tuple(i >= cfg.get("first_k_dense_replace", 3 if family == "deepseek_v3" else 1)
                             for i in range(num_layers)))
        groups = cfg.get("n_group") or 1
        if experts % groups or experts // groups < 2:
            raise ValueError(f"config.json n_group {groups} must split the {experts} experts into groups of >= 2")
        routing = dict(scoring="sigmoid", score_bias=True, n_group=groups, topk_group=cfg.get("topk_group") or 1,
                       routed_scale=float(cfg.get("routed_scaling_factor", 1.0)),
                       shared_size=width * (cfg.get("n_shared_experts") or 0))
        if not 1 <= routing["topk_group"] <= groups:
            raise ValueError(f"config.json topk_group {routing['topk_group']} must be in 1..n_group ({groups})")
    elif family == "gpt_oss":  # softmax over the top-k biased logits = softmax, top-k, renormalised
        experts, width, renormalize = _positive_int(cfg, "num_local_experts"), _positive_int(cfg, "intermediate_size"), True
        layers = (True,) * num_layers
        routing = dict(router_bias=True, expert_biases=True, activation="clamped_swiglu",
                       swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)), swiglu_limit=float(cfg.get("swiglu_limit", 7.0)))
    elif family == "minimax_m2":
        experts, width, renormalize = _positive_int(cfg, "num_local_experts"), _positive_int(cfg, "intermediate_size"), True
        layers = (True,) * num_layers
        routing = dict(scoring="sigmoid", score_bias=True)
    else:
        return None
    top_k = _positive_int(cfg, "num_experts_per_tok")
    if top_k > experts:
        raise ValueError(f"config.json num_experts_per_tok {top_k} exceeds the {experts} experts")
    if cfg.get("shared_expert_intermediate_size") and not routing.get("shared_gate"):
        raise ValueError("config.json has a gated shared expert (shared_expert_intermediate_size); not supported")
    return MoEConfig(experts, top_k, width, renormalize, layers, **routing)


def _architecture(cfg: dict) -> str:
    archs = cfg.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is not None:
        return arch
    model_type = cfg.get("model_type")
    by_type = {**{v: k for k, v in SUPPORTED_ARCHITECTURES.items()}, **_MODEL_TYPES}
    if not archs and model_type in by_type:
        return by_type[model_type]
    raise ValueError(f"unsupported architecture {archs or model_type!r}; supported: "
                     f"{', '.join(SUPPORTED_ARCHITECTURES)}")


def _soft_cap(cfg: dict, key: str) -> float | None:
    value = cfg.get(key)
    if value is not None and not value > 0:
        raise ValueError(f"config.json field '{key}' must be > 0 or null, got {value!r}")
    return None if value is None else float(value)


# multimodal architectures served as their text model: config.json's text_config describes it
TEXT_OF_MULTIMODAL = frozenset({"Gemma3ForConditionalGeneration", "Qwen3_5ForConditionalGeneration",
                                "Qwen3_5MoeForConditionalGeneration"})
# what a multimodal config.json states at its top level for the whole model (the text model's too)
_SHARED_FIELDS = ("dtype", "torch_dtype", "eos_token_id", "tie_word_embeddings")


def _text_config(cfg: dict) -> dict:
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        raise ValueError(f"config.json of a {cfg['architectures'][0]} has no 'text_config' object")
    return {**{k: cfg[k] for k in _SHARED_FIELDS if k in cfg and k not in text}, **text}


def parse_hf_config(cfg: dict) -> dict[str, Any]:
    """ModelConfig's fields from a parsed config.json."""
    arch = _architecture(cfg)
    if arch in TEXT_OF_MULTIMODAL:
        cfg = _text_config(cfg)
    family_name = SUPPORTED_ARCHITECTURES[arch]
    family = FAMILIES[family_name]
    for key, what in _REFUSED.items():
        if cfg.get(key):
            raise ValueError(f"config.json field '{key}' ({what}) is not supported")
    # Gemma writes hidden_activation (hidden_act may be there too, unused by its modeling code)
    act_key = "hidden_activation" if family.gemma_scaling and cfg.get("hidden_activation") else "hidden_act"
    act = cfg.get(act_key, "silu")
    if act not in _ACTIVATIONS:
        raise ValueError(f"unsupported config.json '{act_key}' {act!r}; supported: {', '.join(_ACTIVATIONS)}")
    hidden = _positive_int(cfg, "hidden_size")
    num_layers = _positive_int(cfg, "num_hidden_layers")
    num_heads = _positive_int(cfg, "num_attention_heads")
    num_kv = cfg.get("num_key_value_heads") or num_heads
    mla = parse_mla(cfg) if family_name == "deepseek_v3" else None
    if mla is not None:  # one latent row per token, read by every head
        num_kv = 1
    if num_heads % num_kv:
        raise ValueError(f"num_attention_heads ({num_heads}) must be a multiple of num_key_value_heads ({num_kv})")
    head_dim = mla.latent_dim if mla is not None else cfg.get("head_dim") or hidden // num_heads
    max_pos = _positive_int(cfg, "max_position_embeddings")
    raw_dtype = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    try:
        dtype_name = normalize_dtype_name(raw_dtype)
    except ValueError:
        raise ValueError(f"unsupported config.json 'dtype' {raw_dtype!r}") from None
    attention_bias = bool(cfg.get("attention_bias", False))
    quantization, moe = None, _parse_moe(cfg, family_name, num_layers)
    method = (cfg.get("quantization_config") or {}).get("quant_method")
    if method == "mxfp4":  # gpt-oss: the experts packed, everything else in the checkpoint's dtype
        if moe is None or family_name != "gpt_oss":
            raise ValueError(f"config.json quantization_config quant_method 'mxfp4' is served for gpt-oss experts "
                             f"only, not {arch}")
        moe = dataclasses.replace(moe, expert_format="mxfp4")
    elif cfg.get("quantization_config") is not None:
        from jaxserve.quant.hf_config import scheme_from_hf
        quantization = scheme_from_hf(cfg["quantization_config"])
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    gemma = family.gemma_scaling
    layers = _layer_kinds(cfg, family_name, num_layers, max_pos)
    scale = float(_require(cfg, "query_pre_attn_scalar")) ** -0.5 if gemma else None
    if mla is not None:
        scale = mla_scale(mla, layers[0].rope)
    return dict(
        architecture=arch, family=family_name,
        vocab_size=_positive_int(cfg, "vocab_size"), hidden_size=hidden,
        intermediate_size=_intermediate_size(cfg, moe), num_layers=num_layers,
        num_heads=num_heads, num_kv_heads=num_kv, head_dim=head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), max_position_embeddings=max_pos,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=attention_bias if family.qkv_bias is None else family.qkv_bias,
        o_bias=attention_bias if family.o_bias is None else family.o_bias,
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        qk_norm="head" if family_name == "glm4_moe" and cfg.get("use_qk_norm") else family.qk_norm,
        layers=layers,
        dtype=dtype_name,
        bos_token_id=cfg.get("bos_token_id"), eos_token_ids=eos_ids, quantization=quantization,
        moe=moe,
        norm_placement=family.norm_placement, norm_style=family.norm_style, mlp_act=_ACTIVATIONS[act],
        embed_scale=float(hidden) ** 0.5 if gemma else None,
        attention_scale=scale,
        attn_soft_cap=_soft_cap(cfg, "attn_logit_softcapping") if gemma else None,
        final_soft_cap=_soft_cap(cfg, "final_logit_softcapping") if gemma else None,
        attention_sinks=family_name == "gpt_oss",
        mla=mla,
        linear=parse_linear(cfg, family_name) if family_name in HYBRID_FAMILIES else None,
        attn_output_gate=family_name in HYBRID_FAMILIES,
    )


def _intermediate_size(cfg: dict, moe: MoEConfig | None) -> int:
    """The dense MLP's width; a stack whose every MLP is sparse may leave it out (Qwen3.5-MoE)."""
    if cfg.get("intermediate_size") is None and moe is not None and all(moe.layers):
        return moe.shared_size or moe.intermediate_size
    return _positive_int(cfg, "intermediate_size")
