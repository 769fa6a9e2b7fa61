"""PEFT LoRA adapters against transformers: an adapter written by PEFT (random non-zero B) on each
parity family, read by jaxserve/lora and applied per token through slot one-hots in the forward,
gives the logits of the transformers model with the adapter merged, while rows without an adapter
in the same batch keep the base model's; bad adapters are refused with errors naming the problem."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from checkpoints import load_model
from hf_models import make_hf_model
from jaxserve.lora.adapter import MODULES, load_adapter
from jaxserve.model.lora import LoraInputs
from jaxserve.lora.slots import stack
from jaxserve.model.dense import forward_dense
from jaxserve.parallel.sharding import make_mesh
from peft_adapters import write_adapter

MAX_RANK = 16


def _logits(model, ids) -> np.ndarray:
    with torch.no_grad():
        return model(input_ids=torch.tensor(ids, dtype=torch.long)).logits.numpy()


def _close(ours, ref):
    err = np.abs(ours - ref).max()
    assert err <= 1e-4 * np.abs(ref).max(), f"max abs diff {err} vs max |logit| {np.abs(ref).max()}"


@pytest.mark.parametrize("variant, extra", [
    ("llama3-gqa-tied", {}),
    ("qwen2-bias", dict(use_rslora=True)),
    ("qwen3-qknorm", dict(r=4, modules=("q_proj", "v_proj", "down_proj"))),
    ("mistral-window", {}),
])
def test_adapter_logits_equal_the_merged_transformers_model(variant, extra, tmp_path):
    base_dir, hf = make_hf_model(variant, tmp_path / "base")
    cfg, weights = load_model(base_dir, make_mesh(1, 1))
    ids = np.random.default_rng(2).integers(0, cfg.vocab_size, size=(1, 24)).astype(np.int32)
    base_logits = _logits(hf, ids)
    wrapped = write_adapter(hf, tmp_path / "adapter", seed=3, **extra)
    merged = _logits(wrapped.merge_and_unload(), ids)
    assert np.abs(merged - base_logits).max() > 1e-2  # the adapter changes the model
    adapter = load_adapter(tmp_path / "adapter", cfg, MAX_RANK)
    assert adapter.rank == extra.get("r", 8) and set(adapter.modules) == set(extra.get("modules", MODULES))
    # slot 0 empty, slot 1 the adapter; batch row 0 uses slot 1, row 1 no adapter
    layers = stack([None, adapter], cfg, MAX_RANK)
    one_hot = np.zeros((2, ids.shape[1], 2), np.float32)
    one_hot[0, :, 1] = 1.0
    tokens = np.concatenate([ids, ids])
    ours = np.asarray(forward_dense(weights, cfg, jnp.asarray(tokens), jnp.ones_like(tokens),
                                    lora=LoraInputs([{m: tuple(map(jnp.asarray, f)) for m, f in layer.items()}
                                                     for layer in layers], jnp.asarray(one_hot))))
    _close(ours[0], merged[0])
    _close(ours[1], base_logits[0])


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    d = tmp_path_factory.mktemp("q3")
    base_dir, hf = make_hf_model("qwen3-qknorm", d / "base")
    cfg, _ = load_model(base_dir, make_mesh(1, 1))
    return cfg, hf, d


def _edited(src, dst, **changes):
    import shutil

    shutil.copytree(src, dst)
    meta = json.loads((dst / "adapter_config.json").read_text())
    meta.update(changes)
    (dst / "adapter_config.json").write_text(json.dumps(meta))
    return dst


def test_bad_adapters_are_refused_naming_the_problem(qwen3, tmp_path):
    cfg, hf, d = qwen3
    write_adapter(hf, tmp_path / "ok", seed=1, r=8)
    with pytest.raises(ValueError, match="rank 8 exceeds --max-lora-rank 4"):
        load_adapter(tmp_path / "ok", cfg, max_rank=4)
    for change, words in ((dict(modules_to_save=["lm_head"]), "modules_to_save"),
                          (dict(use_dora=True), "use_dora"), (dict(bias="all"), "bias"),
                          (dict(peft_type="PREFIX_TUNING"), "is not LORA")):
        with pytest.raises(ValueError, match=words):
            load_adapter(_edited(tmp_path / "ok", tmp_path / words.replace(" ", "_"), **change), cfg, MAX_RANK)
    with pytest.raises(ValueError, match="no adapter_config.json"):
        load_adapter(tmp_path, cfg, MAX_RANK)


def test_unsupported_target_modules_and_another_base_model_are_refused(qwen3, tmp_path):
    cfg, hf, d = qwen3
    _, embed_hf = make_hf_model("qwen3-qknorm", tmp_path / "b1")
    write_adapter(embed_hf, tmp_path / "embed", seed=1, modules=("q_proj", "embed_tokens"))
    with pytest.raises(ValueError, match="embed_tokens.*not served"):
        load_adapter(tmp_path / "embed", cfg, MAX_RANK)
    _, wide_hf = make_hf_model("qwen3-qknorm", tmp_path / "b2", hidden_size=96)
    write_adapter(wide_hf, tmp_path / "wide", seed=1)
    with pytest.raises(ValueError, match="another base model"):
        load_adapter(tmp_path / "wide", cfg, MAX_RANK)


def test_an_adapter_is_found_by_hub_id_in_the_local_cache(qwen3, tmp_path, monkeypatch):
    """A hub id resolves through huggingface_hub's cache (never a download); an uncached one is named."""
    import shutil

    from huggingface_hub import constants

    cfg, hf, _ = qwen3
    write_adapter(hf, tmp_path / "written", seed=2, r=4)
    snapshot = tmp_path / "hub" / "models--someone--tiny-lora" / "snapshots" / "0123abcd"
    shutil.copytree(tmp_path / "written", snapshot)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("0123abcd")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    adapter = load_adapter("someone/tiny-lora", cfg, MAX_RANK)
    assert adapter.path == snapshot and adapter.rank == 4 and adapter.name == "tiny-lora"
    with pytest.raises(ValueError, match="'someone/other' is neither a local directory nor in the Hugging Face cache"):
        load_adapter("someone/other", cfg, MAX_RANK)
