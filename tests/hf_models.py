"""Tiny Hugging Face checkpoints written by transformers itself, for parity tests (torch is the oracle)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers

# name -> (config class, model class, config overrides)
_BASE = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256,
             rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)

VARIANTS: dict[str, dict[str, Any]] = {
    "llama2-mha-untied": dict(family="llama", num_key_value_heads=8, tie_word_embeddings=False),
    "llama3-gqa-tied": dict(family="llama", tie_word_embeddings=True, rope_theta=500000.0),
    "llama31-rope-llama3": dict(family="llama", rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 32}),
    "llama-rope-linear-bias": dict(family="llama", attention_bias=True, mlp_bias=True,
                                   rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "llama-rope-dynamic": dict(family="llama", max_position_embeddings=24,
                               rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
    "llama-rope-yarn": dict(family="llama", rope_scaling={"rope_type": "yarn", "factor": 4.0,
                            "original_max_position_embeddings": 64}),
    "qwen2-bias": dict(family="qwen2", tie_word_embeddings=False),
    "qwen2-tied-mqa": dict(family="qwen2", num_key_value_heads=1, tie_word_embeddings=True),
    "qwen3-qknorm": dict(family="qwen3", head_dim=16, tie_word_embeddings=True),
    "qwen3-untied": dict(family="qwen3", head_dim=8, num_key_value_heads=4, tie_word_embeddings=False),
    "mistral-window": dict(family="mistral", sliding_window=8, tie_word_embeddings=False),
}

# Mixtures of experts: kept apart from VARIANTS (the quantization tests iterate over those).
MOE_VARIANTS: dict[str, dict[str, Any]] = {
    # every layer sparse but the second (mlp_only_layers), top-2 of 4 renormalised
    "qwen3-moe": dict(family="qwen3_moe", head_dim=16, num_hidden_layers=3, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1], tie_word_embeddings=False),
    # top-2 of 6 experts without renormalisation, every layer sparse, tied embeddings
    "qwen3-moe-unnormalized": dict(family="qwen3_moe", head_dim=16, num_experts=6, num_experts_per_tok=2,
                                   moe_intermediate_size=24, norm_topk_prob=False, tie_word_embeddings=True),
    "mixtral": dict(family="mixtral", num_local_experts=4, num_experts_per_tok=2, intermediate_size=48,
                    tie_word_embeddings=False),
}

# The layer kinds of 2026 (issue 42): kept apart from VARIANTS (the quantization tests iterate
# over those). Three layers each so a stack mixes kinds; windows of 8 so test prompts pass them.
_GEMMA = dict(head_dim=16, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3,
              query_pre_attn_scalar=24, sliding_window=8, hidden_activation="gelu_pytorch_tanh",
              layer_types=["sliding_attention", "full_attention", "sliding_attention"], pad_token_id=0)
FAMILY_VARIANTS: dict[str, dict[str, Any]] = {
    # soft-capped attention and logits, sandwich norms, scaled embeddings, alternating windows
    "gemma2": dict(family="gemma2", **_GEMMA, attn_logit_softcapping=1.0, final_logit_softcapping=2.0,
                   tie_word_embeddings=True),
    # q/k norms, a RoPE per layer type (local base for sliding layers, linear-scaled global one)
    "gemma3": dict(family="gemma3", **_GEMMA, tie_word_embeddings=True, rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}}),
    # norms after each block only, q/k norms over the whole projection
    "olmo2": dict(family="olmo2", num_hidden_layers=3, tie_word_embeddings=False),
    # no RoPE on the last layer
    "smollm3": dict(family="smollm3", num_hidden_layers=3, no_rope_layers=[1, 1, 0], pad_token_id=0,
                    tie_word_embeddings=True),
    # fused qkv / gate-up projections, half of each head rotated, a window on every layer
    "phi3": dict(family="phi3", num_hidden_layers=3, partial_rotary_factor=0.5, sliding_window=8, pad_token_id=0,
                 tie_word_embeddings=False),
    # a dense first layer, then sigmoid-routed experts (2 of 4 groups kept, bias, scaling) with a
    # shared expert; half of each head rotated, q/k norms, biased q/k/v
    "glm4_moe": dict(family="glm4_moe", num_hidden_layers=3, head_dim=16, num_attention_heads=4, n_routed_experts=8,
                     num_experts_per_tok=3, n_group=4, topk_group=2, routed_scaling_factor=2.5, n_shared_experts=1,
                     moe_intermediate_size=32, first_k_dense_replace=1, use_qk_norm=True, attention_bias=True,
                     pad_token_id=0, tie_word_embeddings=False),
    # sigmoid-routed experts with a choice bias, q/k norms over the whole projection, partial rotary
    "minimax_m2": dict(family="minimax_m2", num_hidden_layers=3, head_dim=16, num_attention_heads=4,
                       num_local_experts=4, num_experts_per_tok=2, intermediate_size=32,
                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
                       pad_token_id=0, tie_word_embeddings=False),
    # attention sinks, alternating windows, biased attention and router, clamped SwiGLU experts
    # with biases, YaRN
    "gpt_oss": dict(family="gpt_oss", num_hidden_layers=3, head_dim=16, num_attention_heads=4, num_local_experts=4,
                    num_experts_per_tok=2, intermediate_size=32, sliding_window=8, pad_token_id=0,
                    rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                     "original_max_position_embeddings": 64, "rope_theta": 150000.0,
                                     "truncate": False},
                    tie_word_embeddings=False),
}

# Multi-head latent attention (issue 43): DeepSeek-V3 with a q LoRA, interleaved YaRN RoPE whose
# mscale_all_dim scales the softmax, a dense first layer, then sigmoid-routed experts (2 of 4
# groups kept) beside a shared expert; and one with a full q projection, plain RoPE in halves and
# one expert group. 4 query heads read one latent row of 32 + 8.
_MLA = dict(num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16,
            qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
            n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5, pad_token_id=0,
            tie_word_embeddings=False)
MLA_VARIANTS: dict[str, dict[str, Any]] = {
    "deepseek_v3": dict(family="deepseek_v3", **_MLA, q_lora_rank=24, n_group=4, topk_group=2, rope_parameters={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "mscale": 1.0,
        "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0, "rope_theta": 10000.0}),
    "deepseek_v3-full-q": dict(family="deepseek_v3", **_MLA, q_lora_rank=None, n_group=1, topk_group=1,
                               rope_interleave=False),
}

# Hybrid linear attention (issue 44): Gated DeltaNet layers (2 key heads of 16 serving 4 value heads
# of 8, a conv of 4 taps) between gated full-attention layers with a quarter of each head rotated.
# Qwen3-Next with fused projections, every layer sparse but the second (a gated shared expert
# beside 2 of 4 experts); Qwen3.5 dense with separate projections; Qwen3.5-MoE.
_HYBRID = dict(num_hidden_layers=4, head_dim=16, num_attention_heads=4, num_key_value_heads=2, linear_num_key_heads=2,
               linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4,
               layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
               pad_token_id=0, tie_word_embeddings=False)
_HYBRID_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
HYBRID_VARIANTS: dict[str, dict[str, Any]] = {
    "qwen3_next": dict(family="qwen3_next", **_HYBRID, **_HYBRID_MOE, mlp_only_layers=[1], norm_topk_prob=True),
    "qwen3_5": dict(family="qwen3_5", **_HYBRID),
    "qwen3_5_moe": dict(family="qwen3_5_moe", **_HYBRID, **_HYBRID_MOE),
}

_CLASSES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
    "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
    "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
    "olmo2": (transformers.Olmo2Config, transformers.Olmo2ForCausalLM),
    "smollm3": (transformers.SmolLM3Config, transformers.SmolLM3ForCausalLM),
    "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
    "glm4_moe": (transformers.Glm4MoeConfig, transformers.Glm4MoeForCausalLM),
    "minimax_m2": (transformers.MiniMaxM2Config, transformers.MiniMaxM2ForCausalLM),
    "gpt_oss": (transformers.GptOssConfig, transformers.GptOssForCausalLM),
    "deepseek_v3": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM),
    "qwen3_next": (transformers.Qwen3NextConfig, transformers.Qwen3NextForCausalLM),
    "qwen3_5": (transformers.Qwen3_5TextConfig, transformers.Qwen3_5ForCausalLM),
    "qwen3_5_moe": (transformers.Qwen3_5MoeTextConfig, transformers.Qwen3_5MoeForCausalLM),
}
ALL_VARIANTS = {**VARIANTS, **MOE_VARIANTS, **FAMILY_VARIANTS, **MLA_VARIANTS, **HYBRID_VARIANTS}


def make_hf_model(variant: str, directory: Path, seed: int = 0, **overrides: Any) -> tuple[Path, Any]:
    """Writes a random tiny model with `save_pretrained` and returns (dir, the torch model in eval mode)."""
    spec = dict(ALL_VARIANTS[variant])
    family = spec.pop("family")
    config_cls, model_cls = _CLASSES[family]
    kwargs = {**_BASE, **spec, **overrides}
    config = config_cls(**kwargs)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_cls(config).eval().to(torch.float32)
    # transformers initialises norms to one and biases to zero; random values exercise them.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            elif name.endswith("bias") or name.endswith("sinks"):
                param.copy_(0.05 * torch.randn_like(param))
        for name, buffer in model.named_buffers():  # an expert-choice bias that matters
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.05 * torch.randn_like(buffer))
    model.save_pretrained(directory, safe_serialization=True)
    return Path(directory), model


def pack_mxfp4_experts(directory: Path, seed: int = 0) -> None:
    """Rewrites a gpt-oss checkpoint's expert projections as gpt-oss publishes them: MXFP4 `_blocks`
    [E, out, in / 32, 16] and `_scales` [E, out, in / 32] of random bytes (scales near 2**-4), with
    config.json's quantization_config saying so."""
    import json

    import numpy as np
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(directory / "model.safetensors"))
    rng = np.random.default_rng(seed)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, inputs, outputs = tensors.pop(name).shape
        tensors[name + "_blocks"] = torch.tensor(rng.integers(0, 256, (experts, outputs, inputs // 32, 16), np.uint8))
        tensors[name + "_scales"] = torch.tensor(rng.integers(121, 125, (experts, outputs, inputs // 32), np.uint8))
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (directory / "config.json").write_text(json.dumps(config))
