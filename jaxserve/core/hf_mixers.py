"""The token mixers beside plain attention, read from a Hugging Face config.json: DeepSeek's latent
attention and the Gated DeltaNet linear attention of Qwen3-Next / Qwen3.5 (hf_families.py calls these)."""

from __future__ import annotations

from jaxserve.core.hf_fields import positive_int
from jaxserve.core.layer_kinds import LinearAttentionConfig, MLAConfig, RopeConfig, yarn_mscale


def parse_mla(cfg: dict) -> MLAConfig:
    """DeepSeek-V3's latent attention fields (head_dim in its config.json is the RoPE key's width)."""
    if cfg.get("attention_bias"):
        raise ValueError("config.json field 'attention_bias' is true: biased latent-attention projections are not supported")
    q_lora = cfg.get("q_lora_rank")
    if q_lora is not None and (not isinstance(q_lora, int) or q_lora <= 0):
        raise ValueError(f"config.json field 'q_lora_rank' must be a positive integer or null, got {q_lora!r}")
    return MLAConfig(kv_lora_rank=positive_int(cfg, "kv_lora_rank"), qk_nope_head_dim=positive_int(cfg, "qk_nope_head_dim"),
                     qk_rope_head_dim=positive_int(cfg, "qk_rope_head_dim"), v_head_dim=positive_int(cfg, "v_head_dim"),
                     q_lora_rank=q_lora, rope_interleave=bool(cfg.get("rope_interleave", True)))


def parse_linear(cfg: dict, family: str) -> LinearAttentionConfig:
    """A hybrid's Gated DeltaNet fields."""
    linear = LinearAttentionConfig(
        num_k_heads=positive_int(cfg, "linear_num_key_heads"), num_v_heads=positive_int(cfg, "linear_num_value_heads"),
        k_head_dim=positive_int(cfg, "linear_key_head_dim"), v_head_dim=positive_int(cfg, "linear_value_head_dim"),
        conv_kernel=positive_int(cfg, "linear_conv_kernel_dim"),
        projections="qkvz" if family == "qwen3_next" else "separate")
    if linear.num_v_heads % linear.num_k_heads:
        raise ValueError(f"config.json linear_num_value_heads ({linear.num_v_heads}) must be a multiple of "
                         f"linear_num_key_heads ({linear.num_k_heads})")
    if linear.conv_kernel < 2:
        raise ValueError(f"config.json linear_conv_kernel_dim must be >= 2, got {linear.conv_kernel}")
    return linear


def mla_scale(mla: MLAConfig, rope: RopeConfig) -> float:
    """The softmax scale: YaRN's mscale_all_dim scales the whole q.k (not only its rotated dims) by mscale^2."""
    scale = mla.qk_head_dim ** -0.5
    if rope.rope_type != "default" and rope.mscale_all_dim:
        scale *= yarn_mscale(rope.factor, rope.mscale_all_dim) ** 2
    return scale
