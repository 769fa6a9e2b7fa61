"""Every device array of a served engine is placed by its layout, as `jaxserve plan` counts it: the
weights, the KV pool, a draft model's weights and pool, and the LoRA slots all take the rules of
--layout (the runner's one `Placement`), not the default tensor-parallel rules; and each is
allocated from the declaration the planner reads its bytes from."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from checkpoints import load_model
from hf_models import make_hf_model
from jaxserve.core.config import EngineConfig, ModelConfig
from jaxserve.engine.engine_core import EngineCore
from jaxserve.model import kv_cache
from jaxserve.model import weights as W
from jaxserve.parallel.layouts import layout_rules
from jaxserve.parallel.sharding import Placement, bytes_per_device, make_mesh
from jaxserve.planning.plan import weight_bytes_per_device
from jaxserve.runner.programs import abstract_lora, kv_dtype

LAYOUTS = ["tp", "tp-kv-replicated"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("placement")
    path, model = make_hf_model("qwen3-untied", directory)  # 4 KV heads: split over 2 devices by "tp"
    from peft_adapters import write_adapter

    write_adapter(model, directory / "adapter", seed=1, r=4)
    return path, directory / "adapter"


def _placed_as(tree, expected) -> list[str]:
    """Paths of the leaves of `tree` not placed as `expected` (a tree of shardings or of abstract
    arrays carrying them) says."""
    wrong = []
    for (where, leaf), want in zip(jax.tree_util.tree_leaves_with_path(tree), jax.tree.leaves(expected)):
        want = getattr(want, "sharding", want)
        if not leaf.sharding.is_equivalent_to(want, leaf.ndim):
            wrong.append(f"{jax.tree_util.keystr(where)}: {leaf.sharding.spec} != {want.spec}")
    return wrong


def _per_device_bytes(tree) -> int:
    return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_array_of_an_engine_with_a_draft_model_and_lora_is_placed_by_its_layout(checkpoint, layout):
    path, adapter = checkpoint
    mesh = make_mesh(1, 2)
    model_cfg, weights = load_model(path, mesh, jnp.float32, None, layout_rules(layout, ModelConfig.from_hf(path)))
    engine_cfg = EngineConfig(layout=layout, max_num_seqs=4, max_num_batched_tokens=32, num_kv_pages=32,
                              speculative_config={"method": "draft_model", "model": str(path),
                                                  "num_speculative_tokens": 2})
    core = EngineCore(model_cfg, weights, engine_cfg, mesh)
    runner = core.runner
    rules = runner.placement.rules
    assert tuple(rules) == tuple(layout_rules(layout, model_cfg))
    placement = Placement(mesh, rules)
    cfg, dtype = runner.model_cfg, kv_dtype(core.engine_cfg, jnp.float32)
    pages, page = core.engine_cfg.num_kv_pages, core.engine_cfg.page_size
    assert _placed_as(runner.weights, W.shardings(W.abstract(cfg), cfg, mesh, rules)) == []
    pool = kv_cache.abstract(cfg, pages, page, dtype, placement)
    assert _placed_as(runner.kv, pool) == []
    draft = runner.draft
    assert _placed_as(draft.weights, W.shardings(W.abstract(draft.cfg), draft.cfg, mesh, rules)) == []
    assert _placed_as(draft.kv, kv_cache.abstract(draft.cfg, pages, page, dtype, placement)) == []
    # what the planner counts per device from the declarations is what the devices hold
    assert _per_device_bytes(runner.weights) == weight_bytes_per_device(cfg, jnp.float32, placement)
    assert _per_device_bytes(draft.weights) == weight_bytes_per_device(draft.cfg, jnp.float32, placement)
    assert _per_device_bytes(runner.kv) == bytes_per_device(pool)

    lora_cfg = EngineConfig(layout=layout, max_num_seqs=4, max_num_batched_tokens=32, num_kv_pages=32,
                            enable_lora=True, lora_modules=(("a", str(adapter)),), max_loras=2, max_lora_rank=8)
    lora = EngineCore(model_cfg, weights, lora_cfg, mesh).runner.lora
    slots = abstract_lora(cfg, lora_cfg, jnp.float32, placement)
    assert _placed_as(lora.arrays, slots) == []
    assert _per_device_bytes(lora.arrays) == bytes_per_device(slots) > 0

