"""Tensor parallelism wider than the KV head count: each KV head is duplicated to one per device
(model/kv_heads.py). The engine then generates exactly what it generates on one device, while each
device holds one KV head of projections and pages."""

from __future__ import annotations

import numpy as np
import pytest

from checkpoints import load_model
from engine_utils import greedy, make_core, run_all
from hf_models import make_hf_model
from jaxserve.core.config import EngineConfig
from jaxserve.parallel.layouts import make_layout
from jaxserve.model.kv_heads import repeat_kv
from jaxserve.parallel.kv_heads import kv_duplication
from jaxserve.model.weights import init_random
from jaxserve.planning.plan import plan_deployment
from jaxserve.core.request import Request
from jaxserve.parallel.sharding import make_mesh
from jaxserve.planning.targets import parse_target


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    # 8 query heads, 2 KV heads (GQA 4), q/k norms, biases off
    path, _ = make_hf_model("qwen3-qknorm", tmp_path_factory.mktemp("qwen3"))
    return path


PROMPTS = [[5, 17, 33, 2, 9, 41, 7, 3], [60, 3, 3, 88], [14, 90, 31, 5, 5, 70, 11, 12, 13, 14, 15]]


def _generate(path, mesh):
    cfg, weights = load_model(path, mesh)
    core = make_core(cfg, weights, mesh)
    out = run_all(core, [Request(f"r{i}", p, greedy(10)) for i, p in enumerate(PROMPTS)])
    return core, [out[f"r{i}"][0] for i in range(len(PROMPTS))]


@pytest.mark.parametrize("model_axis", [4, 8])
def test_duplicated_kv_heads_generate_what_one_device_does(qwen3, model_axis):
    _, alone = _generate(qwen3, make_mesh(1, 1))
    core, split = _generate(qwen3, make_mesh(1, model_axis))
    assert split == alone
    runner = core.runner
    assert runner.model_cfg.num_kv_heads == model_axis          # 2 heads, each repeated model_axis / 2 times
    wk = runner.weights.layers[0].wk                              # [D, KVH', hd]
    assert wk.shape[1] == model_axis and wk.addressable_shards[0].data.shape[1] == 1
    k_pages = runner.kv.k[0]                                      # [P, ps, KVH', hd]
    assert k_pages.shape[2] == model_axis and k_pages.addressable_shards[0].data.shape[2] == 1


def test_repeat_order_keeps_each_query_head_on_its_own_kv_head():
    from jaxserve.core.config import ModelConfig
    cfg = ModelConfig.from_hf({"architectures": ["Qwen2ForCausalLM"], "vocab_size": 64, "hidden_size": 32,
                               "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 8,
                               "num_key_value_heads": 2, "max_position_embeddings": 64})
    w = init_random(cfg)
    r = repeat_kv(w, 4)
    wk, rk = np.asarray(w.layers[0].wk), np.asarray(r.layers[0].wk)
    group, new_group = cfg.num_heads // 2, cfg.num_heads // 8
    for h in range(cfg.num_heads):                                 # query head h reads the same K either way
        np.testing.assert_array_equal(rk[:, h // new_group], wk[:, h // group])
    np.testing.assert_array_equal(np.asarray(r.layers[0].bk)[5], np.asarray(w.layers[0].bk)[1])


def test_duplication_applies_only_to_multiples_that_split_the_query_heads():
    from jaxserve.core.config import ModelConfig
    base = {"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 48, "intermediate_size": 32,
            "num_hidden_layers": 1, "max_position_embeddings": 64}
    gqa = ModelConfig.from_hf({**base, "num_attention_heads": 8, "num_key_value_heads": 2})
    assert [kv_duplication(gqa, n) for n in (1, 2, 4, 8)] == [1, 1, 2, 4]
    three = ModelConfig.from_hf({**base, "num_attention_heads": 12, "num_key_value_heads": 3})
    assert kv_duplication(three, 4) == 1 and kv_duplication(three, 6) == 2
    assert kv_duplication(gqa, 4, make_layout("tp-kv-replicated", 4).rules) == 1


def test_planner_sees_one_kv_head_per_device_and_the_kernel():
    from jaxserve.core.config import ModelConfig
    cfg = ModelConfig.from_hf({"architectures": ["Qwen3ForCausalLM"], "vocab_size": 1024, "hidden_size": 256,
                               "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 8,
                               "num_key_value_heads": 2, "head_dim": 128, "max_position_embeddings": 512})
    engine = EngineConfig(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=256, kv_cache_memory=2**30)
    target = parse_target("tpu-v6e:2x2")
    dup = plan_deployment(cfg, target, make_layout("tp", 4), engine, "bfloat16")
    rep = plan_deployment(cfg, target, make_layout("tp-kv-replicated", 4), engine, "bfloat16")
    # the same 1 GiB pool holds twice the tokens when a device keeps 1 of 4 heads instead of all 2
    assert dup.max_kv_tokens > 1.9 * rep.max_kv_tokens
    assert any("duplicated 2x" in n for n in dup.notes) and any("whole on every device" in n for n in rep.notes)
