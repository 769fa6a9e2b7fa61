"""Checkpoint loading: orbax round trip, sharded placement, and errors that name the problem."""

from __future__ import annotations

import json
import shutil

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from checkpoints import load_model, orbax_io, resolve_model_dir
from hf_models import make_hf_model
from jaxserve.model import weights as W
from jaxserve.parallel.sharding import make_mesh


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path, _ = make_hf_model("qwen2-bias", tmp_path_factory.mktemp("hf"))
    return path


def _leaves_equal(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        assert x.shape == y.shape and x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_orbax_round_trip_equals_load_on_any_mesh(hf_dir, tmp_path):
    mesh = make_mesh(1, 4)
    cfg, loaded = load_model(hf_dir, mesh)
    dst = orbax_io.save(loaded, tmp_path / "converted", src_model_dir=hf_dir)
    assert (dst / "config.json").is_file() and orbax_io.is_converted(dst)
    cfg2, restored = load_model(dst, mesh)
    assert cfg2 == cfg
    _leaves_equal(restored, loaded)
    assert jax.tree.map(lambda a: a.sharding, restored) == jax.tree.map(lambda a: a.sharding, loaded)
    # Restoring onto another layout places each array on that layout's shardings.
    _, other = load_model(dst, make_mesh(2, 2))
    _leaves_equal(other, loaded)
    assert other.layers[0].wq.sharding.spec == W.shardings(W.abstract(cfg), cfg, make_mesh(2, 2)).layers[0].wq.spec
    with pytest.raises(FileExistsError, match="already exists"):
        orbax_io.save(loaded, dst)


def test_each_device_holds_only_its_shard(hf_dir):
    cfg, weights = load_model(hf_dir, make_mesh(1, 8))
    emb = weights.embed  # [Vp, D] split over the vocabulary
    assert {s.data.shape for s in emb.addressable_shards} == {(W.padded_vocab(cfg) // 8, cfg.hidden_size)}


def test_missing_directory_and_offline_hub_id_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model_dir(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="nor in the Hugging Face cache.*`hf download some-org"):
        resolve_model_dir("some-org/some-model-that-is-not-cached")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        resolve_model_dir(tmp_path / "empty")


def test_missing_safetensors_and_missing_tensor(hf_dir, tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    shutil.copy(hf_dir / "config.json", d / "config.json")
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors files"):
        load_model(d, make_mesh(1, 1))
    tensors = load_file(str(hf_dir / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(ValueError, match="missing tensors.*model.layers.1.mlp.up_proj.weight"):
        load_model(d, make_mesh(1, 1))


def test_wrong_shape_names_the_tensor(hf_dir, tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    shutil.copy(hf_dir / "config.json", d / "config.json")
    tensors = load_file(str(hf_dir / "model.safetensors"))
    tensors["model.layers.0.self_attn.o_proj.weight"] = tensors["model.layers.0.self_attn.o_proj.weight"][:, :-8]
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(ValueError, match="model.layers.0.self_attn.o_proj.weight"):
        load_model(d, make_mesh(1, 1))


def test_unexpected_tensor_and_unknown_architecture(hf_dir, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(hf_dir, d)
    tensors = load_file(str(d / "model.safetensors"))
    tensors["model.layers.0.mystery.weight"] = np.zeros(3, np.float32)
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(ValueError, match="unexpected tensor 'model.layers.0.mystery.weight'"):
        load_model(d, make_mesh(1, 1))
    config = json.loads((hf_dir / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    config["model_type"] = "gpt2"
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unsupported architecture.*GPT2LMHeadModel"):
        load_model(d, make_mesh(1, 1))


def test_sharded_safetensors_index(hf_dir, tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    shutil.copy(hf_dir / "config.json", d / "config.json")
    tensors = load_file(str(hf_dir / "model.safetensors"))
    names = sorted(tensors)
    half = len(names) // 2
    save_file({n: tensors[n] for n in names[:half]}, str(d / "a.safetensors"))
    save_file({n: tensors[n] for n in names[half:]}, str(d / "b.safetensors"))
    index = {"weight_map": {n: ("a.safetensors" if i < half else "b.safetensors") for i, n in enumerate(names)}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    ticks: list[tuple[int, int]] = []  # the loading bar's: one per tensor, across both files
    cfg, sharded = load_model(d, make_mesh(1, 1), progress=lambda done, total: ticks.append((done, total)))
    assert ticks == [(i, len(names)) for i in range(len(names) + 1)]
    _, single = load_model(hf_dir, make_mesh(1, 1))
    _leaves_equal(sharded, single)
    (d / "b.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="b.safetensors"):
        load_model(d, make_mesh(1, 1))
    assert cfg.family == "qwen2"


@pytest.mark.parametrize("variant", ["llama2-mha-untied", "qwen3-qknorm"])
def test_reading_only_each_devices_slices_places_the_same_weights(variant, tmp_path):
    """Multi-host loading (checkpoints.hf.SliceReads): each tensor read through a memory map, one
    slice per device, the padded vocabulary filled with zeros, equals reading every tensor whole."""
    import jax
    import numpy as np

    from checkpoints.hf import SliceReads, load_weights
    from jaxserve.core.config import ModelConfig
    from jaxserve.parallel.sharding import make_mesh

    path, _ = make_hf_model(variant, tmp_path)
    cfg = ModelConfig.from_hf(path)
    assert cfg.padded_vocab_size > cfg.vocab_size  # the zero rows come from the placement
    mesh = make_mesh(1, 4)
    whole = load_weights(path, cfg, mesh)
    slices = SliceReads()
    sliced = load_weights(path, cfg, mesh, slices=slices)
    for (where, a), b in zip(jax.tree_util.tree_leaves_with_path(whole), jax.tree.leaves(sliced)):
        assert a.sharding == b.sharding, where
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=str(where))
    assert slices.read == slices.total > 0  # one process holds every device: it reads everything once


def test_each_safetensors_header_is_read_once_per_load(tmp_path, monkeypatch):
    """A sliced (memory-mapped) load opens each file's header once, not once per tensor."""
    import builtins

    from checkpoints import hf
    from checkpoints.hf import SliceReads, load_weights
    from jaxserve.core.config import ModelConfig

    path, _ = make_hf_model("qwen3-qknorm", tmp_path)
    cfg = ModelConfig.from_hf(path)
    files = sorted(path.glob("*.safetensors"))
    opened: list[str] = []

    def counting_open(file, *args, **kwargs):
        if str(file).endswith(".safetensors"):
            opened.append(str(file))
        return builtins.open(file, *args, **kwargs)

    monkeypatch.setattr(hf, "open", counting_open, raising=False)
    load_weights(path, cfg, make_mesh(1, 2), slices=SliceReads())
    assert sorted(opened) == [str(f) for f in files]  # one header read per file
    assert len(hf.tensor_names(path)) > len(files)  # while the files hold more tensors than that
