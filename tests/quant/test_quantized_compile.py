"""Quantized weights compile for a TPU this machine does not have (compile-only, from shapes): the
largest forward bucket with the Mosaic attention kernel under TP=4 on a v6e-4, for every online
scheme and for the zero-point and activation-order leaves of AWQ / GPTQ checkpoints; the weights
arrive on the device in their packed types, so the program's arguments shrink accordingly."""

from __future__ import annotations

import dataclasses

import pytest

from jaxserve.buckets import serving_programs
from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.layouts import make_layout
from jaxserve.model.attention import make_attention
from jaxserve.programs import lower_program
from jaxserve.quant.scheme import ONLINE, WeightQuant
from jaxserve.sharding import make_mesh
from jaxserve.targets import parse_target

QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 1000, "hidden_size": 1024,
         "intermediate_size": 2048, "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4,
         "head_dim": 128, "max_position_embeddings": 512, "tie_word_embeddings": True}
ENGINE = EngineConfig(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=256, num_kv_pages=64)
SCHEMES = {**ONLINE,
           "awq": WeightQuant("awq", "uint4", group_size=128, zero_point=True, checkpoint_format="awq"),
           "gptq-act-order": WeightQuant("gptq", "uint4", group_size=128, zero_point=True, checkpoint_format="gptq",
                                         act_order=True)}
HLO_TYPE = {"int8": "s8[", "int4": "s4[", "fp8": "f8e4m3fn[", "awq": "u4[", "gptq-act-order": "u4["}


def _compile(cfg, mesh, layout):
    attention = make_attention("auto", cfg, mesh, layout.rules)
    program = max((p for p in serving_programs(ENGINE, cfg) if p.kind == "forward"), key=lambda p: p.tokens)
    return lower_program(program, cfg, ENGINE, mesh, "bfloat16", attention, layout.rules).compile()


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
