"""Quantized weights compile for a TPU this machine does not have (compile-only, from shapes): the
largest forward bucket with the Mosaic attention kernel under TP=4 on a v6e-4, for every online
scheme and for the zero-point and activation-order leaves of AWQ / GPTQ checkpoints; the weights
arrive on the device in their packed types, so the program's arguments shrink accordingly. With
8-bit KV pages the same program keeps its pages and scales split over the KV heads. The
`gpu_compile` tests compile the same programs for two H100s (the Triton kernel under TP=2)."""

from __future__ import annotations

import dataclasses

import pytest

from jaxserve.core.buckets import serving_programs
from jaxserve.core.config import EngineConfig, ModelConfig
from jaxserve.parallel.layouts import make_layout
from jaxserve.model.attention import make_attention
from jaxserve.runner.programs import lower_program
from jaxserve.quant.scheme import ONLINE, WeightQuant
from jaxserve.parallel.sharding import make_mesh, Placement
from jaxserve.planning.targets import parse_target

QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 1000, "hidden_size": 1024,
         "intermediate_size": 2048, "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4,
         "head_dim": 128, "max_position_embeddings": 512, "tie_word_embeddings": True}
ENGINE = EngineConfig(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=256, num_kv_pages=64)
SCHEMES = {**ONLINE,
           "awq": WeightQuant("awq", "uint4", group_size=128, zero_point=True, checkpoint_format="awq"),
           "gptq-act-order": WeightQuant("gptq", "uint4", group_size=128, zero_point=True, checkpoint_format="gptq",
                                         act_order=True)}
HLO_TYPE = {"int8": "s8[", "int4": "s4[", "fp8": "f8e4m3fn[", "awq": "u4[", "gptq-act-order": "u4["}


def _compile(cfg, mesh, layout, engine=ENGINE):
    placement = Placement(mesh, layout.rules)
    attention = make_attention("auto", cfg, placement)
    program = max((p for p in serving_programs(engine, cfg) if p.kind == "forward"), key=lambda p: p.tokens)
    return lower_program(program, cfg, engine, placement, "bfloat16", attention).compile()


@pytest.fixture(scope="module")
def tpu():
    devices = parse_target("tpu-v6e:2x2").devices()
    layout = make_layout("tp", len(devices), 4)
    mesh = make_mesh(1, 4, devices)
    base = ModelConfig.from_hf(QWEN3)
    return mesh, layout, base, _compile(base, mesh, layout).memory_analysis().argument_size_in_bytes


@pytest.mark.parametrize("name", list(SCHEMES))
def test_quantized_forward_compiles_for_tpu_with_packed_weights(tpu, name):
    mesh, layout, base, bf16_args = tpu
    cfg = dataclasses.replace(base, quantization=SCHEMES[name])
    compiled = _compile(cfg, mesh, layout)
    text = compiled.as_text()
    assert "tpu_custom_call" in text                       # the attention kernel, as unquantized
    assert HLO_TYPE[name] in text                          # the weights stay packed in HBM
    # 2 layers x 7 projections of 1024 x (1024 | 512 | 2048): 22 Mi params; bf16 args hold them at 2 bytes
    assert compiled.memory_analysis().argument_size_in_bytes < bf16_args


@pytest.mark.parametrize("kv_cache_dtype,hlo_type", [("int8", "s8["), ("fp8_e5m2", "f8e5m2[")])
def test_quantized_kv_pages_compile_for_tpu_split_over_kv_heads(tpu, kv_cache_dtype, hlo_type):
    mesh, layout, base, _ = tpu
    cfg = dataclasses.replace(base, quantization=ONLINE["int8"])
    compiled = _compile(cfg, mesh, layout, dataclasses.replace(ENGINE, kv_cache_dtype=kv_cache_dtype))
    text = compiled.as_text()
    assert "tpu_custom_call" in text
    # per device: one of the 4 KV heads of the 64 x 16-token pages, and its [64, 1, 16] f32 scales
    assert f"{hlo_type}64,16,1,128]" in text and "f32[64,1,16]" in text


@pytest.fixture(scope="module")
def h100s():
    from jaxserve.planning.gpu_target import gpu_devices

    devices = gpu_devices("h100", "1x1x2")
    return make_mesh(1, 2, devices), make_layout("tp", 2, 2), ModelConfig.from_hf(QWEN3)


@pytest.mark.gpu_compile
@pytest.mark.parametrize("name", list(SCHEMES))
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "fp8"])
def test_quantized_forward_compiles_for_two_h100s(h100s, name, kv_cache_dtype):
    mesh, layout, base = h100s
    cfg = dataclasses.replace(base, quantization=SCHEMES[name])
    compiled = _compile(cfg, mesh, layout, dataclasses.replace(ENGINE, kv_cache_dtype=kv_cache_dtype))
    text = compiled.as_text()
    assert "__gpu$xla.gpu.triton" in text                 # the Triton attention kernel
    assert HLO_TYPE[name] in text
