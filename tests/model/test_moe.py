"""Mixtures of experts (Qwen3-MoE, Mixtral) against transformers' PyTorch models: full-sequence
logits, greedy generation through the engine, tensor and expert parallelism on 8 fake devices equal
to one device, and the grouped matmul against its definition."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import jax
import jax.numpy as jnp
from checkpoints import load_model
from engine_utils import greedy, make_core, run_all
from hf_models import MOE_VARIANTS, make_hf_model
from own_process import in_own_process
from jaxserve.parallel.layouts import RULE_SETS
from jaxserve.model.dense import forward_dense
from jaxserve.model.moe import grouped_matmul, route
from jaxserve.core.request import Request
from jaxserve.parallel.sharding import make_mesh

from test_parity import _hf_generate, _hf_logits, assert_logits_close


@pytest.mark.parametrize("variant", sorted(MOE_VARIANTS))
def test_full_sequence_logits_match_transformers(variant, tmp_path):
    path, model = make_hf_model(variant, tmp_path)
    cfg, weights = load_model(path, make_mesh(1, 1))
    assert cfg.moe is not None
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, size=(2, 40)).astype(np.int32)
    mask = np.ones_like(ids)
    ours = np.asarray(forward_dense(weights, cfg, jnp.asarray(ids), jnp.asarray(mask)))
    assert_logits_close(ours, _hf_logits(model, ids, mask))
    # the routing is not trivial: the tokens of this batch reach every expert
    layer = next(lw for lw in weights.layers if lw.router is not None)
    _, experts = route(layer.router, jnp.take(weights.embed, jnp.asarray(ids.reshape(-1)), axis=0), cfg.moe)
    assert len(np.unique(np.asarray(experts))) == cfg.moe.num_experts


def test_configs_name_the_sparse_layers():
    import dataclasses

    from jaxserve.core.config import ModelConfig
    from jaxserve.model.weights import abstract, is_quantized
    from jaxserve.quant.scheme import online_scheme

    base = {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 96, "hidden_size": 64, "intermediate_size": 96,
            "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
            "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
    assert ModelConfig.from_hf(base).moe.layers == (True,) * 4
    assert ModelConfig.from_hf({**base, "decoder_sparse_step": 2, "mlp_only_layers": [3]}).moe.layers == (
        False, True, False, False)
    with pytest.raises(ValueError, match="num_experts_per_tok 9 exceeds the 8 experts"):
        ModelConfig.from_hf({**base, "num_experts_per_tok": 9})
    with pytest.raises(ValueError, match="shared expert"):
        ModelConfig.from_hf({**base, "shared_expert_intermediate_size": 64})
    quantized = abstract(dataclasses.replace(ModelConfig.from_hf(base), quantization=online_scheme("int8")))
    experts = quantized.layers[0].we_gate  # int8 per output channel of each expert: scale [E, 1, Fe]
    assert experts.qvalue.shape == (8, 64, 32) and experts.scale.shape == (8, 1, 32)
    assert experts.scale.axes == ("expert", None, "expert_mlp") and not is_quantized(quantized.layers[0].router)


@pytest.mark.parametrize("rows", [10, 100])  # the CPU's loop over non-empty groups; tokamax's ragged_dot
def test_grouped_matmul_is_a_matmul_per_contiguous_group(rows):
    from jaxserve.model.moe import SKIP_EMPTY_MAX_ROWS

    assert (rows <= SKIP_EMPTY_MAX_ROWS) == (rows == 10)
    rng = np.random.default_rng(0)
    lhs = rng.standard_normal((rows, 8), dtype=np.float32)
    rhs = rng.standard_normal((3, 8, 5), dtype=np.float32)
    sizes = np.array([4, 0, rows - 4], np.int32)  # an expert no token chose
    want = np.concatenate([lhs[:4] @ rhs[0], lhs[4:] @ rhs[2]])
    got = np.asarray(grouped_matmul(jnp.asarray(lhs), jnp.asarray(rhs), jnp.asarray(sizes)))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@in_own_process
def test_tokamax_leaves_the_command_line_alone(monkeypatch):
    """tokamax reads its options as absl flags and parses sys.argv on first read unless absl's flags
    count as parsed: `jaxserve serve --model ...` would be rejected (UnrecognizedFlagError)."""
    from absl import flags

    from jaxserve.model import moe

    monkeypatch.setattr("sys.argv", ["jaxserve", "serve", "--model", "some/dir"])
    flags.FLAGS.unparse_flags()
    assert moe._tokamax().config.cross_compile.value is False


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    return make_hf_model("mixtral", tmp_path_factory.mktemp("mixtral"))


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    return make_hf_model("qwen3-moe", tmp_path_factory.mktemp("qwen3moe"))


PROMPTS = [[5, 17, 33, 2, 9, 41, 7], [60, 3, 3, 88, 12, 19, 4, 70, 21, 11, 56, 8, 23], list(range(3, 45))]


@pytest.mark.parametrize("which", ["mixtral", "qwen3_moe"])
def test_engine_greedy_equals_transformers_generate(which, request):
    path, model = request.getfixturevalue(which)
    cfg, weights = load_model(path, make_mesh(1, 1))
    core = make_core(cfg, weights)
    got = run_all(core, [Request(f"r{i}", p, greedy(12)) for i, p in enumerate(PROMPTS)])
    for i, p in enumerate(PROMPTS):
        assert got[f"r{i}"][0] == _hf_generate(model, [p], 12)[0], i
    assert core.runner.compilations_after_warmup == 0


@pytest.mark.parametrize("tp,rules", [(2, "tp"), (4, "tp"), (2, "tp-ep"), (4, "tp-ep")])
def test_tensor_and_expert_parallel_equal_one_device(qwen3_moe, tp, rules):
    """TP inside every expert (the expert MLP width split) and expert parallelism (whole experts per
    device) give one device's logits."""
    from checkpoints.hf import load_weights
    from jaxserve.core.config import ModelConfig

    path, _ = qwen3_moe
    cfg = ModelConfig.from_hf(path)
    ids = np.random.default_rng(2).integers(0, cfg.vocab_size, size=(2, 24)).astype(np.int32)
    mask = np.ones_like(ids)
    one = np.asarray(forward_dense(load_weights(path, cfg, make_mesh(1, 1)), cfg, jnp.asarray(ids), jnp.asarray(mask)))
    mesh = make_mesh(1, tp)
    import jaxserve.model.weights as W
    specs = W.abstract(cfg)
    placed = jax.device_put(load_weights(path, cfg, make_mesh(1, 1)), W.shardings(specs, cfg, mesh, RULE_SETS[rules]))
    experts = placed.layers[0].we_gate.sharding.spec
    assert (experts[0] == "model") == (rules == "tp-ep") and (experts[2] == "model") == (rules == "tp")
    sharded = np.asarray(forward_dense(placed, cfg, jnp.asarray(ids), jnp.asarray(mask)))
    np.testing.assert_allclose(sharded, one, rtol=2e-5, atol=2e-5)


def test_engine_with_experts_split_over_four_devices_equals_transformers(qwen3_moe):
    """Serving on a 4-way model axis (each expert's MLP width split, KV heads duplicated)."""
    path, model = qwen3_moe
    mesh = make_mesh(1, 4)
    cfg, weights = load_model(path, mesh)
    assert weights.layers[0].we_up.sharding.spec[2] == "model"
    core = make_core(cfg, weights, mesh=mesh)
    got = run_all(core, [Request(f"r{i}", p, greedy(10)) for i, p in enumerate(PROMPTS)])
    for i, p in enumerate(PROMPTS):
        assert got[f"r{i}"][0] == _hf_generate(model, [p], 10)[0], i
    assert core.runner.compilations_after_warmup == 0


# the leaves a Qwen3-MoE layer leaves None (routing biases, expert biases, a shared expert)
NO_EXTRAS = dict.fromkeys(("choice_bias", "router_bias", "be_gate", "be_up", "be_down", "ws_gate", "ws_up", "ws_down"))


@pytest.mark.parametrize("data,model,expert_axis,tensor_axis", [
    (1, 2, "model", None), (1, 4, "model", None), (1, 8, "model", None),  # EP = 2 / 4 / 8
    (2, 4, "data", "model"), (4, 2, "data", "model"),                    # EP x TP
])
@pytest.mark.parametrize("tokens", [5, 24])  # 5: padded to a multiple of the expert axis
def test_all_to_all_expert_parallel_equals_the_unsharded_block(data, model, expert_axis, tensor_axis, tokens):
    """Tokens dispatched to their experts' devices and back by all-to-all give moe_mlp's output."""
    from types import SimpleNamespace

    from jaxserve.core.layer_kinds import MoEConfig
    from jaxserve.model.expert_parallel import make_expert_parallel
    from jaxserve.model.moe import moe_mlp

    e, d, f = 8, 16, 12
    rng = np.random.default_rng(tokens)
    arrays = [jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((d, e), (e, d, f), (e, d, f), (e, f, d))]
    x = jnp.asarray(rng.standard_normal((tokens, d)), jnp.float32)
    moe = MoEConfig(e, 2, f, True, (True,))
    layer = lambda r, g, u, w: SimpleNamespace(router=r, we_gate=g, we_up=u, we_down=w, **NO_EXTRAS)  # noqa: E731
    block = make_expert_parallel(make_mesh(data, model), expert_axis, tensor_axis)
    run = jax.jit(lambda x, *a: block(layer(*a), x, moe))
    want = moe_mlp(layer(*arrays), x, moe)
    np.testing.assert_allclose(np.asarray(run(x, *arrays)), np.asarray(want), rtol=1e-5, atol=1e-4)
    text = run.lower(x, *arrays).compile().as_text()
    assert text.count("all-to-all(") >= 3, "dispatch (rows, ids) and combine"


@pytest.mark.parametrize("mesh_shape,layout", [((1, 4), "tp-ep"), ((2, 4), "tp-ep-data")])
def test_engine_serves_expert_parallel_layouts_like_transformers(qwen3_moe, mesh_shape, layout):
    """--layout tp-ep (EP=4) and tp-ep-data (EP=2 x TP=4): whole experts per device, tokens moved by
    all-to-all; greedy generation equals transformers', nothing compiles after warm-up."""
    path, model = qwen3_moe
    mesh = make_mesh(*mesh_shape)
    cfg, weights = load_model(path, mesh, rules=RULE_SETS[layout])
    spec = weights.layers[0].we_gate.sharding.spec
    assert spec[0] == ("model" if layout == "tp-ep" else "data")
    core = make_core(cfg, weights, mesh=mesh, layout=layout)
    assert core.runner._moe is not None
    got = run_all(core, [Request(f"r{i}", p, greedy(10)) for i, p in enumerate(PROMPTS)])
    for i, p in enumerate(PROMPTS):
        assert got[f"r{i}"][0] == _hf_generate(model, [p], 10)[0], i
    assert core.runner.compilations_after_warmup == 0


def test_expert_parallel_layouts_need_experts():
    from jaxserve.core.config import ModelConfig
    from jaxserve.parallel.layouts import layout_rules

    dense = ModelConfig.from_hf({"architectures": ["Qwen3ForCausalLM"], "vocab_size": 64, "hidden_size": 32,
                                 "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
                                 "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 64})
    with pytest.raises(ValueError, match="layout 'tp-ep' splits experts, and Qwen3ForCausalLM has none"):
        layout_rules("tp-ep", dense)
    with pytest.raises(ValueError, match="unknown layout 'ep'"):
        layout_rules("ep", dense)
