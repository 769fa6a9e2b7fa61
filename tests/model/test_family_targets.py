"""The 2026 families compile for targets this machine does not have, from shapes alone: gpt-oss
(attention sinks in the Mosaic / Triton kernels, MXFP4 experts dequantized in the step, biased
clamped-SwiGLU experts), Gemma 2 (soft-capped, alternately windowed attention) and DeepSeek-V3
(latent attention at its real head shapes) and Qwen3-Next (Gated DeltaNet layers at their real head
widths) on a v6e-4 and on two H100s with the experts' width and the heads split four / two ways. Small widths, the real
structure: a top-4 of 8 routing at a 256-token step is where tokamax's Mosaic ragged-dot kernel
is chosen, which XLA cannot partition (the experts run shard-mapped: expert_parallel.make_tensor_parallel)."""

from __future__ import annotations

import dataclasses

import pytest

from jaxserve.core.buckets import Program
from jaxserve.core.config import EngineConfig, ModelConfig
from jaxserve.model.attention import make_attention
from jaxserve.parallel.kv_heads import duplicated_config, kv_duplication
from jaxserve.parallel.layouts import make_layout
from jaxserve.parallel.sharding import Placement, make_mesh
from jaxserve.planning.targets import parse_target
from jaxserve.runner.programs import lower_program
from own_process import in_own_process

_BASE = {"vocab_size": 1000, "hidden_size": 256, "intermediate_size": 256, "num_hidden_layers": 2,
         "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 1024}
CONFIGS = {
    "gpt_oss": {**_BASE, "architectures": ["GptOssForCausalLM"], "head_dim": 64, "sliding_window": 128,
                "layer_types": ["sliding_attention", "full_attention"], "attention_bias": True,
                "num_local_experts": 8, "num_experts_per_tok": 4, "rope_theta": 150000,
                "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                 "original_max_position_embeddings": 4096, "truncate": False},
                "quantization_config": {"quant_method": "mxfp4"}},
    "gemma2": {**_BASE, "architectures": ["Gemma2ForCausalLM"], "head_dim": 128, "query_pre_attn_scalar": 128,
               "sliding_window": 128, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
               "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True},
}
# DeepSeek-V3's attention at its real per-device shapes (128 heads over 8 devices: 16 here over 4), its
# latent row of 512 + 64, noaux_tc experts in small widths
CONFIGS["deepseek_v3"] = {**_BASE, "architectures": ["DeepseekV3ForCausalLM"], "num_attention_heads": 64,
                          "num_key_value_heads": 64, "kv_lora_rank": 512, "q_lora_rank": 128, "qk_rope_head_dim": 64,
                          "qk_nope_head_dim": 128, "v_head_dim": 128, "n_routed_experts": 8, "num_experts_per_tok": 4,
                          "n_group": 2, "topk_group": 1, "moe_intermediate_size": 128, "n_shared_experts": 1,
                          "first_k_dense_replace": 1, "rope_scaling": {
                              "type": "yarn", "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32,
                              "beta_slow": 1, "original_max_position_embeddings": 4096}}
# Qwen3-Next: Gated DeltaNet layers at their real head shapes (16 key / 32 value heads of 128: here 4 / 8)
# between gated attention layers of 256-wide heads, a quarter rotated; a gated shared expert
CONFIGS["qwen3_next"] = {**_BASE, "architectures": ["Qwen3NextForCausalLM"], "num_hidden_layers": 4, "head_dim": 256,
                         "num_attention_heads": 8, "num_key_value_heads": 4, "partial_rotary_factor": 0.25,
                         "full_attention_interval": 2, "linear_num_key_heads": 4, "linear_num_value_heads": 8,
                         "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
                         "num_experts": 8, "num_experts_per_tok": 4, "moe_intermediate_size": 128,
                         "shared_expert_intermediate_size": 128}
ENGINE = EngineConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=512, num_kv_pages=64)


def _compiled_forward(family: str, target: str, tp: int, engine: EngineConfig = ENGINE) -> str:
    devices = parse_target(target).devices()
    layout = make_layout("tp", len(devices), tp)
    mesh = make_mesh(1, layout.tp, devices)
    placement = Placement(mesh, layout.rules)
    cfg = ModelConfig.from_hf(CONFIGS[family])
    cfg = duplicated_config(cfg, kv_duplication(cfg, layout.tp, layout.rules))  # as the runner places it
    program = Program("forward", tokens=256, rows=8)
    return lower_program(program, cfg, engine, placement, "bfloat16", make_attention("auto", cfg, placement)
                         ).compile().as_text()


@pytest.mark.parametrize("family", sorted(CONFIGS))
@in_own_process
def test_forward_compiles_for_a_v6e_4_with_its_kernels(family):
    text = _compiled_forward(family, "tpu-v6e:2x2", 4)
    kernels = sum(1 for line in text.splitlines() if "tpu_custom_call" in line and "custom-call(" in line)
    # attention per layer; gpt-oss: the experts' three grouped matmuls per layer too
    assert kernels >= (4 if family == "gpt_oss" else 1) * 2, kernels
    assert "all-reduce" in text
    if family == "deepseek_v3":  # one latent row per device (duplicated, padded to 640 lanes), read by the Mosaic kernel
        assert "bf16[64,16,1,640]" in text and "ragged_paged_attention_tpu" in text


@pytest.mark.gpu_compile
@in_own_process
def test_gpt_oss_forward_compiles_for_two_h100s():
    text = _compiled_forward("gpt_oss", "gpu-h100:1x1x2", 2)
    assert "__gpu$xla.gpu.triton" in text or "triton" in text.lower()


@pytest.mark.gpu_compile
@in_own_process
def test_qwen3_next_forward_compiles_for_two_h100s():
    """The Gated DeltaNet layers (the jnp reference: XLA's loops) beside the Triton attention kernel."""
    text = _compiled_forward("qwen3_next", "gpu-h100:1x1x2", 2)
    assert "ragged_paged_attention_gpu" in text and "while" in text


@pytest.mark.gpu_compile
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
@in_own_process
def test_deepseek_v3_latent_attention_compiles_for_two_h100s(kv_cache_dtype):
    """32 heads per device over one duplicated latent row of 576 (bf16 or fp8 pages), read once as keys
    and values by the Triton kernel shard-mapped over the heads."""
    text = _compiled_forward("deepseek_v3", "gpu-h100:1x1x2", 2, dataclasses.replace(ENGINE, kv_cache_dtype=kv_cache_dtype))
    # the latent read by the Triton attention kernel itself (in 512 + 64 lane parts), not the jnp reference
    assert "ragged_paged_attention_gpu" in text
    assert f"{'f8e4m3fn' if kv_cache_dtype == 'fp8' else 'bf16'}[64,16,1,576]" in text


@pytest.mark.parametrize("tokens", [16, 256])
@in_own_process
def test_a_tpu_step_writes_and_reads_a_head_dim_64_pool_in_place(tokens):
    """gpt-oss's 64-wide heads: a TPU pool keeps each head's K and V side by side in one 128-lane array
    (kv_groups.fused_kv), so a step, decode or prefill, writes and reads its two layers' one shared
    pool array (a sliding and a full layer group) where it lies. As two 64-wide arrays, XLA:TPU laid
    the pool out with its pages minor and copied each array into the scatter's and the kernel's
    layouts every step: over 98 MiB of temporaries here, three times one array's 32 MiB."""
    cfg = ModelConfig.from_hf(CONFIGS["gpt_oss"])
    assert (cfg.kv_groups.num_groups, cfg.kv_groups.num_arrays) == (2, 1)
    engine = EngineConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=512, num_kv_pages=2048)
    mesh = make_mesh(1, 1, parse_target("tpu-v6e:1x1").devices())
    placement = Placement(mesh, make_layout("tp", 1, 1).rules)
    compiled = lower_program(Program("forward", tokens=tokens, rows=8), cfg, engine, placement, "bfloat16",
                             make_attention("auto", cfg, placement)).compile()
    array_bytes = engine.num_kv_pages * engine.page_size * cfg.num_kv_heads * 128 * 2  # bf16, K|V in 128 lanes
    assert f"bf16[{engine.num_kv_pages},{engine.page_size},{cfg.num_kv_heads},128]" in compiled.as_text()
    assert compiled.memory_analysis().temp_size_in_bytes < array_bytes / 4


@pytest.mark.parametrize("tokens", [16, 256])
@in_own_process
def test_a_tpu_step_writes_and_reads_the_latent_pool_in_place(tokens):
    """DeepSeek-V3's latent row of 576 lanes is stored in 640 on a TPU (kv_groups.pool_head_dim, latent):
    a step, decode or prefill, then writes and reads the pool where it lies. Stored as 576 lanes (4.5
    tiles) XLA:TPU copied every latent array into the scatter's and the kernel's layouts each step:
    162 MiB of temporaries for two 144 MiB arrays here, against ~3 MiB padded."""
    cfg = ModelConfig.from_hf(CONFIGS["deepseek_v3"])
    placement = Placement(make_mesh(1, 1, parse_target("tpu-v6e:1x1").devices()), make_layout("tp", 1, 1).rules)
    engine = EngineConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=512, num_kv_pages=8192)
    compiled = lower_program(Program("forward", tokens=tokens, rows=8), cfg, engine, placement, "bfloat16",
                             make_attention("auto", cfg, placement)).compile()
    array_bytes = engine.num_kv_pages * engine.page_size * 640 * 2  # bf16, one latent head padded to 640 lanes
    assert f"bf16[{engine.num_kv_pages},{engine.page_size},1,640]" in compiled.as_text()
    assert compiled.memory_analysis().temp_size_in_bytes < array_bytes / 16
