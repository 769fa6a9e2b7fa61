"""ModelConfig.from_hf: transformers-5 and older config styles, and errors naming the field."""

from __future__ import annotations

import pytest

from jaxserve.core.config import EngineConfig, ModelConfig

BASE = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=100, hidden_size=64,
            intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=128)


def test_transformers5_and_legacy_rope_configs_agree():
    v5 = ModelConfig.from_hf({**BASE, "dtype": "bfloat16", "rope_parameters": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}})
    legacy = ModelConfig.from_hf({**BASE, "torch_dtype": "bfloat16", "rope_theta": 500000.0, "rope_scaling": {
        "type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}})
    assert v5 == legacy
    assert v5.rope.rope_type == "llama3" and v5.rope.theta == 500000.0 and v5.dtype == "bfloat16"
    assert v5.head_dim == 16 and v5.q_per_kv == 2


def test_family_features():
    qwen2 = ModelConfig.from_hf({**BASE, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"})
    assert qwen2.qkv_bias and not qwen2.o_bias and not qwen2.qk_norm
    qwen3 = ModelConfig.from_hf({**BASE, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "head_dim": 32})
    assert qwen3.qk_norm and qwen3.head_dim == 32 and not qwen3.qkv_bias
    mistral = ModelConfig.from_hf({**BASE, "architectures": ["MistralForCausalLM"], "sliding_window": 16})
    assert mistral.layer_windows == (16, 16)
    layered = ModelConfig.from_hf({**BASE, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 8,
                                   "layer_types": ["full_attention", "sliding_attention"]})
    assert layered.layer_windows == (None, 8)


@pytest.mark.parametrize("patch,message", [
    ({"architectures": ["BertModel"], "model_type": "bert"}, "unsupported architecture"),
    ({"hidden_size": None}, "missing required field 'hidden_size'"),
    ({"num_hidden_layers": -1}, "'num_hidden_layers' must be a positive integer"),
    ({"num_key_value_heads": 3}, "multiple of num_key_value_heads"),
    ({"hidden_act": "gelu"}, "'hidden_act'"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1.0}}, "unsupported RoPE type 'longrope'"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0}}, "original_max_position_embeddings"),
    ({"dtype": "int4"}, "unsupported config.json 'dtype'"),
    ({"layer_types": ["full_attention"]}, "'layer_types' has 1 entries for 2 layers"),
    ({"layer_types": ["full_attention", "chunked_attention"]}, r"'layer_types' has unsupported entries \['chunked"),
    ({"attention_chunk_size": 8192}, "'attention_chunk_size' \\(chunked attention\\) is not supported"),
    ({"use_bidirectional_attention": True}, "'use_bidirectional_attention'"),
    ({"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3"},
     "config.json of a Gemma3ForConditionalGeneration has no 'text_config' object"),
    ({"architectures": ["PaliGemmaForConditionalGeneration"], "model_type": "paligemma"},
     "unsupported architecture \\['PaliGemmaForConditionalGeneration'\\]"),
    ({"partial_rotary_factor": 1.5}, "'partial_rotary_factor' must be in"),
    ({"rope_parameters": {"full_attention": {"rope_theta": 1e6}}, "layer_types": ["full_attention", "sliding_attention"],
      "sliding_window": 4}, "no entry for layer type 'sliding_attention'"),
    ({"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "head_dim": 16}, "'query_pre_attn_scalar'"),
    ({"architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "n_routed_experts": 6, "n_group": 4,
      "num_experts_per_tok": 2, "moe_intermediate_size": 8}, "n_group 4 must split the 6 experts"),
])
def test_bad_configs_name_the_problem(patch, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf({**BASE, **patch})


def test_missing_config_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        ModelConfig.from_hf(tmp_path)


def test_engine_config_validation_and_buckets():
    cfg = EngineConfig(max_num_batched_tokens=256, max_num_seqs=16)
    assert cfg.resolved_token_buckets() == (16, 64, 128, 256)  # 16 x 4^k below half the budget
    assert cfg.resolved_seq_buckets() == (4, 8, 16)
    with pytest.raises(ValueError, match="max_num_batched_tokens must be >= max_num_seqs"):
        EngineConfig(max_num_batched_tokens=8, max_num_seqs=16)
    with pytest.raises(ValueError, match="scheduling_policy"):
        EngineConfig(scheduling_policy="lifo")
