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

_CLASSES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
}


def make_hf_model(variant: str, directory: Path, seed: int = 0, **overrides: Any) -> tuple[Path, Any]:
    """Writes a random tiny model with `save_pretrained` and returns (dir, the torch model in eval mode)."""
    spec = dict(VARIANTS[variant] if variant in VARIANTS else MOE_VARIANTS[variant])
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
            elif name.endswith("bias"):
                param.copy_(0.05 * torch.randn_like(param))
    model.save_pretrained(directory, safe_serialization=True)
    return Path(directory), model
