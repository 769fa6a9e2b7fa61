"""What varies along a decoder stack, as data: each layer's attention (window, RoPE) and the
sparse MLP's routing. `ModelConfig` (config.py) holds them; hf_families.py reads them from a
Hugging Face config.json."""

from __future__ import annotations

import dataclasses
import math


def yarn_mscale(factor: float, m: float = 1.0) -> float:
    """YaRN's magnitude correction for a context stretched by `factor`."""
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    rope_type: str = "default"
    theta: float = 10000.0
    factor: float = 1.0
    # llama3
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    # yarn
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True
    partial_rotary_factor: float = 1.0  # the share of each head's dims rotated (the first ones); the rest pass

    def rotary_dim(self, head_dim: int) -> int:
        return int(head_dim * self.partial_rotary_factor)


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Sparse mixture-of-experts MLPs. Routing: "softmax" over the router's logits (Qwen3-MoE,
    Mixtral), or "sigmoid" scores whose choice adds a learned per-expert bias and may first keep the
    best `topk_group` of `n_group` expert groups (GLM-4.5, MiniMax-M2, DeepSeek-V3); the top-k
    weights renormalised to sum to one where the model says so, then scaled by `routed_scale`.
    A shared expert (a dense gated MLP of width `shared_size`) adds to every token's output."""
    num_experts: int
    top_k: int
    intermediate_size: int         # each expert's MLP width
    renormalize: bool              # Mixtral always; Qwen3-MoE: norm_topk_prob
    layers: tuple[bool, ...]       # per layer: a sparse MoE block (else the dense MLP)
    scoring: str = "softmax"       # "softmax" | "sigmoid"
    score_bias: bool = False       # sigmoid: a learned bias (e_score_correction_bias) added for the choice only
    n_group: int = 1               # groups of experts, ranked by the sum of their best two biased scores
    topk_group: int = 1            # groups kept before the top-k
    routed_scale: float = 1.0      # routed_scaling_factor
    shared_size: int = 0           # the shared expert's MLP width (0: none)
    shared_gate: bool = False      # the shared expert's output x sigmoid(x . w) (Qwen3-Next, Qwen3.5-MoE)
    router_bias: bool = False      # the router's logits carry a bias (gpt-oss)
    expert_biases: bool = False    # every expert projection carries a bias (gpt-oss)
    # the experts' activation: "silu" (SwiGLU) or "clamped_swiglu" (gpt-oss: gate clamped above at
    # swiglu_limit, up to +-swiglu_limit, gate * sigmoid(alpha * gate) * (up + 1))
    activation: str = "silu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    expert_format: str = "dense"   # the experts' weights as held: "dense" or "mxfp4" (packed, quant/mxfp4.py)


@dataclasses.dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi K2): each token caches one latent row
    [kv_lora_rank + qk_rope_head_dim] (the normalised compressed K/V, then the shared RoPE key)
    read by every head. Queries come from a low-rank projection (q_lora_rank; None: one full
    projection), each head's q is [qk_nope_head_dim + qk_rope_head_dim], its output v_head_dim."""
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    # the checkpoint rotates RoPE dims in adjacent pairs (DeepSeek's layout); the loader permutes
    # those weight rows to the halves layout the model rotates (the dot products are unchanged)
    rope_interleave: bool = True

    @property
    def latent_dim(self) -> int:
        """One cached row: the latent, then the RoPE key (the pool's head_dim)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclasses.dataclass(frozen=True)
class LinearAttentionConfig:
    """Gated DeltaNet linear attention (Qwen3-Next, Qwen3.5): per sequence and linear layer a
    fixed-size state instead of K/V pages, a causal-conv window [conv_kernel - 1, conv_dim] and a
    delta-rule matrix [num_v_heads, k_head_dim, v_head_dim] (model/linear_attention.py). q and k
    have num_k_heads heads, each serving num_v_heads / num_k_heads value heads."""
    num_k_heads: int
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int
    # the checkpoint's input projections: "qkvz" (Qwen3-Next: in_proj_qkvz and in_proj_ba, grouped
    # per key head) or "separate" (Qwen3.5: in_proj_qkv, in_proj_z, in_proj_b, in_proj_a)
    projections: str = "separate"

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.k_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.v_head_dim

    @property
    def conv_dim(self) -> int:
        """The conv's channels: q, k and v side by side."""
        return 2 * self.key_dim + self.value_dim


@dataclasses.dataclass(frozen=True)
class LayerKind:
    """What one decoder layer's attention is: a stack of 2026 mixes kinds (gpt-oss and Gemma
    alternate sliding and full layers, Gemma 3 gives each its own RoPE base, SmolLM3 drops RoPE
    on every fourth layer)."""
    window: int | None = None                  # sliding window in tokens (q - k < window); None: full
    rope: RopeConfig | None = RopeConfig()     # this layer's RoPE; None: no rotary embedding (NoPE)
    # the token mixer: "attention" (K/V pages), or "linear" (ModelConfig.linear: a recurrent state,
    # no pages; window and rope unused)
    mixer: str = "attention"

    @property
    def linear(self) -> bool:
        return self.mixer == "linear"
