"""`--load-format dummy`: random weights drawn on the devices from config.json alone
(checkpoints/random_init.py), placed and shaped as a loaded checkpoint would be."""

from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from checkpoints import load_model
from hf_models import make_hf_model
from jaxserve.core.config import EngineConfig
from jaxserve.model import weights as W
from jaxserve.quant import host as quant_host
from jaxserve.parallel.sharding import make_mesh


@pytest.fixture(scope="module")
def config_only(tmp_path_factory):
    """A model directory with the checkpoint's config.json and tokenizer, but no weights."""
    path, _ = make_hf_model("qwen3-qknorm", tmp_path_factory.mktemp("hf"))
    bare = tmp_path_factory.mktemp("bare")
    for f in path.iterdir():
        if not f.name.endswith(".safetensors"):
            shutil.copy(f, bare / f.name)
    return path, bare


def _placed(tree):
    return jax.tree.map(lambda a: (a.shape, a.dtype, a.sharding), tree)


def test_dummy_weights_have_the_checkpoints_shapes_dtypes_and_shardings(config_only):
    full, bare = config_only
    mesh = make_mesh(2, 4)
    cfg, loaded = load_model(full, mesh, jnp.bfloat16)
    dummy_cfg, dummy = load_model(bare, mesh, jnp.bfloat16, load_format="dummy")
    assert dummy_cfg == cfg
    assert _placed(dummy) == _placed(loaded)
    wq = np.asarray(dummy.layers[0].wq, np.float32)
    assert 0.015 < wq.std() < 0.025 and abs(wq.mean()) < 0.002  # normal(0, 0.02), as init_random
    np.testing.assert_array_equal(np.asarray(dummy.layers[1].attn_norm, np.float32), 1.0)
    # the same seed on another mesh: the same values
    _, again = load_model(bare, make_mesh(1, 2), jnp.bfloat16, load_format="dummy")
    for a, b in zip(jax.tree.leaves(dummy), jax.tree.leaves(again)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    # leaves of the same shape are drawn apart
    assert not np.array_equal(np.asarray(dummy.layers[0].wq), np.asarray(dummy.layers[1].wq))


def test_dummy_int8_weights_are_quantized_on_the_device_by_the_loaders_rule(config_only):
    _, bare = config_only
    cfg, weights = load_model(bare, make_mesh(1, 2), jnp.float32, quantization="int8", load_format="dummy")
    wq = weights.layers[0].wq
    assert W.is_quantized(wq) and wq.qvalue.dtype == jnp.int8 and cfg.quantization.method == "int8"
    values = np.asarray(wq.qvalue).astype(np.float32) * quant_host.broadcast_scale(np.asarray(wq.scale),
                                                                                   wq.qvalue.shape)
    again, scale = quant_host.quantize(values, np.int8, wq.scale.shape)  # the host rule leaves them as they are
    np.testing.assert_array_equal(again, np.asarray(wq.qvalue))
    np.testing.assert_allclose(scale, np.asarray(wq.scale), rtol=1e-6)
    assert np.abs(np.asarray(wq.qvalue)).max() == 127  # absmax per channel reaches the top code


def test_unknown_load_format_is_refused_by_name(config_only):
    with pytest.raises(ValueError, match="load-format"):
        EngineConfig(load_format="safetensors")
    with pytest.raises(ValueError, match="load_format"):
        load_model(config_only[1], make_mesh(1, 1), load_format="pt")
    with pytest.raises(FileNotFoundError, match="safetensors"):  # without dummy a bare directory is an error
        load_model(config_only[1], make_mesh(1, 1))
    assert json.loads((config_only[1] / "config.json").read_text())["model_type"] == "qwen3"
