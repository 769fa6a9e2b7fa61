"""Numerical parity with transformers' PyTorch models: full-sequence logits and greedy generation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import jax.numpy as jnp
from checkpoints import load_model
from hf_models import VARIANTS, make_hf_model
from jaxserve.model.dense import forward_dense, greedy_generate, left_pad
from jaxserve.parallel.sharding import make_mesh

PROMPTS = [[5, 17, 33, 2, 9, 41, 7], [60, 3, 3, 88, 12, 19, 4, 70, 21, 11, 56, 8, 23], [14, 90, 31]]


def _hf_logits(model, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(input_ids=torch.tensor(ids, dtype=torch.long),
                     attention_mask=torch.tensor(mask, dtype=torch.long)).logits.numpy()


def _hf_generate(model, prompts, n: int) -> list[list[int]]:
    ids, mask = left_pad(prompts, max(map(len, prompts)))
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor(ids, dtype=torch.long),
                             attention_mask=torch.tensor(mask, dtype=torch.long), do_sample=False,
                             max_new_tokens=n, min_new_tokens=n, pad_token_id=0, eos_token_id=None)
    return out[:, ids.shape[1]:].tolist()


def assert_logits_close(ours: np.ndarray, ref: np.ndarray) -> None:
    err = np.abs(ours - ref).max()
    assert err <= 1e-4 * np.abs(ref).max(), f"max abs diff {err} vs max |logit| {np.abs(ref).max()}"


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_full_sequence_logits_match_transformers(variant, tmp_path):
    path, model = make_hf_model(variant, tmp_path)
    cfg, weights = load_model(path, make_mesh(1, 1))
    # Long enough to pass the Mistral window (8) and dynamic RoPE's max_position_embeddings (24).
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, size=(2, 40)).astype(np.int32)
    mask = np.ones_like(ids)
    ours = np.asarray(forward_dense(weights, cfg, jnp.asarray(ids), jnp.asarray(mask)))
    assert_logits_close(ours, _hf_logits(model, ids, mask))


@pytest.mark.parametrize("variant", ["llama3-gqa-tied", "qwen2-bias", "qwen3-qknorm", "mistral-window"])
def test_left_padded_batch_logits_match(variant, tmp_path):
    path, model = make_hf_model(variant, tmp_path)
    cfg, weights = load_model(path, make_mesh(1, 1))
    ids, mask = left_pad(PROMPTS, 13)
    ours = np.asarray(forward_dense(weights, cfg, jnp.asarray(ids), jnp.asarray(mask)))
    ref = _hf_logits(model, ids, mask)
    valid = mask.astype(bool)  # padded query rows are meaningless in both
    assert_logits_close(ours[valid], ref[valid])


@pytest.mark.parametrize("variant", ["llama2-mha-untied", "llama31-rope-llama3", "llama-rope-yarn",
                                     "qwen2-tied-mqa", "qwen3-qknorm", "mistral-window"])
def test_greedy_generation_matches_generate(variant, tmp_path):
    path, model = make_hf_model(variant, tmp_path)
    cfg, weights = load_model(path, make_mesh(1, 1))
    assert greedy_generate(weights, cfg, PROMPTS, 32) == _hf_generate(model, PROMPTS, 32)


def test_sliding_window_is_exercised(tmp_path):
    """The Mistral parity above would be vacuous if the window never masked anything."""
    path, model = make_hf_model("mistral-window", tmp_path)
    cfg, weights = load_model(path, make_mesh(1, 1))
    ids = np.random.default_rng(2).integers(0, cfg.vocab_size, size=(1, 30)).astype(np.int32)
    windowed = np.asarray(forward_dense(weights, cfg, jnp.asarray(ids), jnp.ones_like(jnp.asarray(ids))))
    import dataclasses
    full_cfg = dataclasses.replace(cfg, layers=tuple(dataclasses.replace(k, window=None) for k in cfg.layers))
    full = np.asarray(forward_dense(weights, full_cfg, jnp.asarray(ids), jnp.ones_like(jnp.asarray(ids))))
    assert np.allclose(windowed[:, :8], full[:, :8], atol=1e-5)  # inside the window: identical
    assert np.abs(windowed[:, 8:] - full[:, 8:]).max() > 1e-3    # past it: the window matters
