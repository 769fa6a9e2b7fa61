"""The same parity with weights sharded over 8 fake CPU devices, for every mesh shape."""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch
from jax.sharding import AxisType, NamedSharding, PartitionSpec

import jax.numpy as jnp
from checkpoints import load_model
from hf_models import make_hf_model
from jaxserve.model.dense import forward_dense, greedy_generate, left_pad
from jaxserve.parallel.sharding import DATA_AXIS, make_mesh

MESHES = [(1, 1), (1, 2), (1, 4), (1, 8), (2, 4)]


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    # 8 q heads, 2 KV heads: the 1x4 and 1x8 meshes have a model axis larger than the KV head count.
    return make_hf_model("qwen3-qknorm", tmp_path_factory.mktemp("qwen3"))


def test_eight_fake_devices_present():
    assert len(jax.devices()) == 8


@pytest.mark.parametrize("data,model_axis", MESHES)
def test_sharded_logits_and_generation_match(qwen3, data, model_axis):
    path, hf_model = qwen3
    mesh = make_mesh(data, model_axis)
    assert mesh.axis_types == (AxisType.Auto, AxisType.Auto)
    cfg, weights = load_model(path, mesh)
    wq = weights.layers[0].wq
    assert wq.sharding.spec == PartitionSpec(None, "model" if model_axis > 1 else None, None)
    # KV heads (2) are split only when the model axis divides them; otherwise replicated.
    kv_split = model_axis > 1 and cfg.num_kv_heads % model_axis == 0
    assert weights.layers[0].wk.sharding.spec == PartitionSpec(None, "model" if kv_split else None, None)
    assert wq.addressable_shards[0].data.shape[1] == cfg.num_heads // model_axis

    prompts = [[5, 17, 33, 2, 9, 41, 7, 3], [60, 3, 3, 88], [14, 90, 31, 5, 5], [1, 2, 3, 4, 5, 6]]
    ids, mask = left_pad(prompts, 8)
    batch_sharding = NamedSharding(mesh, PartitionSpec(DATA_AXIS, None))
    ours = np.asarray(forward_dense(weights, cfg, jax.device_put(jnp.asarray(ids), batch_sharding),
                                    jax.device_put(jnp.asarray(mask), batch_sharding)))
    with torch.no_grad():
        ref = hf_model(input_ids=torch.tensor(ids, dtype=torch.long),
                       attention_mask=torch.tensor(mask, dtype=torch.long)).logits.numpy()
    valid = mask.astype(bool)
    assert np.abs(ours[valid] - ref[valid]).max() <= 1e-4 * np.abs(ref[valid]).max()

    with torch.no_grad():
        hf_out = hf_model.generate(input_ids=torch.tensor(ids, dtype=torch.long),
                                   attention_mask=torch.tensor(mask, dtype=torch.long), do_sample=False,
                                   max_new_tokens=12, min_new_tokens=12, pad_token_id=0, eos_token_id=None)
    assert greedy_generate(weights, cfg, prompts, 12) == hf_out[:, 8:].tolist()
