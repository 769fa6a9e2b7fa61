"""Quantized weights through the serving engine: the paged ragged step on quantized leaves gives the
dense parity path's greedy tokens, batched == alone, on one device and sharded, with zero
compilations after warm-up; the planner and the start-up block see the quantized bytes."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import pytest

from checkpoints import load_model
from engine_utils import greedy, make_core, run_all
from formats import write_awq, write_gptq
from hf_models import make_hf_model
from jaxserve.core.config import ModelConfig
from jaxserve.model.dense import greedy_generate
from jaxserve.planning.plan import weight_bytes_per_device
from jaxserve.quant.scheme import ONLINE
from jaxserve.core.request import Request
from jaxserve.parallel.sharding import make_mesh, Placement

PROMPTS = [[5, 17, 33, 2, 9, 41, 7], [60, 3, 3, 88, 12, 19, 4, 70, 21, 11, 56, 8, 23], [14, 90, 31]]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return make_hf_model("qwen3-untied", tmp_path_factory.mktemp("base"), hidden_size=256, intermediate_size=384,
                         head_dim=64, num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module")
def awq_dir(base, tmp_path_factory):
    dst = tmp_path_factory.mktemp("awq") / "model"
    write_awq(base[0], dst)
    return dst


@pytest.fixture(scope="module")
def gptq_act_order_dir(base, tmp_path_factory):
    dst = tmp_path_factory.mktemp("gptq") / "model"
    write_gptq(base[0], dst, bits=4, sym=False, act_order=True)
    return dst


@pytest.mark.parametrize("source,mesh_shape", [("int4", (1, 1)), ("fp8", (1, 2)), ("awq", (1, 1)), ("awq", (1, 2)),
                                               ("gptq-act-order", (1, 2))])
def test_engine_greedy_equals_dense_path_batched_and_alone(base, awq_dir, gptq_act_order_dir, source, mesh_shape):
    mesh = make_mesh(*mesh_shape)
    if source in ("awq", "gptq-act-order"):
        cfg, weights = load_model(awq_dir if source == "awq" else gptq_act_order_dir, mesh)
    else:
        cfg, weights = load_model(base[0], mesh, quantization=source)
    expected = greedy_generate(weights, cfg, PROMPTS, 10)
    core = make_core(cfg, weights, mesh)
    batched = run_all(core, [Request(f"r{i}", p, greedy(10)) for i, p in enumerate(PROMPTS)])
    assert [batched[f"r{i}"][0] for i in range(len(PROMPTS))] == expected
    alone = run_all(core, [Request("alone", PROMPTS[1], greedy(10))])
    assert alone["alone"][0] == expected[1]
    assert core.runner.compilations_after_warmup == 0


def test_planner_bytes_and_startup_block_see_the_quantization():
    cfg = ModelConfig.from_hf(dict(architectures=["LlamaForCausalLM"], vocab_size=32000, hidden_size=1024,
                                   intermediate_size=4096, num_hidden_layers=4, num_attention_heads=16,
                                   num_key_value_heads=8, max_position_embeddings=4096, tie_word_embeddings=False))
    mesh = make_mesh(1, 1)
    full = weight_bytes_per_device(cfg, jnp.bfloat16, Placement(mesh))
    projections = 4 * (2 * 1024 * 1024 + 2 * 1024 * 512 + 3 * 1024 * 4096)  # q, o, k, v, gate, up, down
    rest = full - 2 * projections
    for name, bits in (("int8", 8), ("int4", 4), ("fp8", 8)):
        quant = weight_bytes_per_device(dataclasses.replace(cfg, quantization=ONLINE[name]), jnp.bfloat16,
                                        Placement(mesh))
        # the projections shrink to bits/16 of bf16 plus their scales; the rest is unchanged
        assert rest + projections * bits // 8 < quant < rest + projections * bits // 8 * 1.05
    from jaxserve.core.capacity import MachineInfo, plan_capacity
    from jaxserve.core.config import EngineConfig

    machine = MachineInfo("cpu", "test cpu", memory_per_device=8 << 30, cpu_cores=2, cpu_isa="avx2")
    lines = plan_capacity(EngineConfig(), dataclasses.replace(cfg, quantization=ONLINE["int4"]), machine, 4).lines
    assert "weights: int4 (int4 weights, groups of 128)" in lines
