"""gpt-oss's MXFP4 experts loaded as published (packed bytes on the devices) and dequantized in the
step, against transformers: its own dequantizer on the same bytes, and its model loaded from the
same checkpoint with `Mxfp4Config(dequantize=True)`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from checkpoints import load_model
from engine_utils import greedy, make_core, run_all
from hf_models import make_hf_model, pack_mxfp4_experts
from jaxserve.core.config import ModelConfig
from jaxserve.core.request import Request
from jaxserve.model.dense import forward_dense
from jaxserve.parallel.sharding import make_mesh
from jaxserve.quant import mxfp4

PROMPTS = [[5, 17, 33, 2, 9, 41, 7], list(range(3, 45))]


def test_dequantize_equals_transformers_on_the_same_bytes():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    rng = np.random.default_rng(3)
    blocks = rng.integers(0, 256, (3, 8, 4, 16), np.uint8)     # [E, out, in / 32, 16]
    scales = rng.integers(110, 140, (3, 8, 4), np.uint8)       # every power of two from 2**-17 to 2**12
    ours = np.asarray(mxfp4.dequantize(mxfp4.Mxfp4(jnp.asarray(blocks), jnp.asarray(scales)), jnp.float32))
    ref = convert_moe_packed_tensors(torch.tensor(blocks), torch.tensor(scales), dtype=torch.float32).numpy()
    assert ours.shape == (3, 128, 8) and np.array_equal(ours, ref)
    # computed in bfloat16 (no float32 copy of the experts in the step): the same values, exactly
    in_bf16 = mxfp4.dequantize(mxfp4.Mxfp4(jnp.asarray(blocks), jnp.asarray(scales)), jnp.bfloat16)
    assert in_bf16.dtype == jnp.bfloat16 and np.array_equal(np.asarray(in_bf16.astype(jnp.float32)), ref)


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    path, _ = make_hf_model("gpt_oss", tmp_path_factory.mktemp("gpt_oss_mxfp4"))
    pack_mxfp4_experts(path)
    reference = transformers.GptOssForCausalLM.from_pretrained(
        path, quantization_config=transformers.Mxfp4Config(dequantize=True), dtype=torch.float32).eval()
    return path, reference


def test_experts_stay_packed_and_the_logits_equal_transformers(packed):
    path, reference = packed
    cfg, weights = load_model(path, make_mesh(1, 1))
    assert cfg.moe.expert_format == "mxfp4" and cfg.quantization is None
    gate = weights.layers[0].we_gate
    # the expert width 32 held padded to 256 (zero codes): whole packed groups per device at TP <= 8
    assert gate.blocks.dtype == jnp.uint8 and gate.blocks.shape == (4, 256, 2, 16) and gate.scales.shape == (4, 256, 2)
    assert weights.layers[0].wq.dtype == jnp.float32  # attention as stored
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, size=(2, 40)).astype(np.int32)
    ours = np.asarray(forward_dense(weights, cfg, jnp.asarray(ids), jnp.ones_like(jnp.asarray(ids))))
    with torch.no_grad():
        ref = reference(input_ids=torch.tensor(ids, dtype=torch.long)).logits.numpy()
    assert np.abs(ours - ref).max() <= 1e-4 * np.abs(ref).max()


def test_engine_greedy_equals_transformers_generate(packed):
    path, reference = packed
    core = make_core(*load_model(path, make_mesh(1, 1)))
    got = run_all(core, [Request(f"r{i}", p, greedy(10)) for i, p in enumerate(PROMPTS)])
    for i, p in enumerate(PROMPTS):
        with torch.no_grad():
            out = reference.generate(input_ids=torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                     do_sample=False, max_new_tokens=10, min_new_tokens=10, pad_token_id=0,
                                     eos_token_id=None)
        assert got[f"r{i}"][0] == out[0, len(p):].tolist(), i
    assert core.runner.compilations_after_warmup == 0


def test_mxfp4_outside_gpt_oss_is_refused_by_name():
    config = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": 64,
              "quantization_config": {"quant_method": "mxfp4"}}
    with pytest.raises(ValueError, match="'mxfp4' is served for gpt-oss experts only, not Qwen3ForCausalLM"):
        ModelConfig.from_hf(config)


def test_dequantize_is_elementwise_with_no_gather():
    """A table lookup per weight is a gather over every expert weight, which XLA:TPU offloads to the
    SparseCore: gpt-oss-20b's v6e-4 step then held 17.69 GiB of temporaries (694 MiB without) and
    libtpu's SparseCore code generator crashed in 3 of 4 compiles."""
    w = mxfp4.Mxfp4(jnp.zeros((2, 8, 4, 16), jnp.uint8), jnp.zeros((2, 8, 4), jnp.uint8))
    primitives = {eqn.primitive.name for eqn in jax.make_jaxpr(lambda w: mxfp4.dequantize(w, jnp.bfloat16))(w).eqns}
    assert not {p for p in primitives if "gather" in p or "scatter" in p}, primitives
