"""The distribution speculation verifies against is the one sampling draws from: `target_probs`
equals `sample`'s empirical distribution, and tokens emitted through `verify` over it follow it, for
temperature, top-k, top-p and min-p (chi-square on 10^5 rows, p > 1e-3)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.stats import chisquare

from jaxserve.sampler import SamplingRow, SamplingTensors, _seed_words, sample, target_probs
from jaxserve.sampling_params import SamplingParams
from jaxserve.spec.rejection import verify

ROWS, V, K = 100_000, 16, 2
PARAMS = {
    "temperature": SamplingParams(temperature=0.7),
    "top_k": SamplingParams(temperature=1.0, top_k=3),
    "top_p": SamplingParams(temperature=1.0, top_p=0.6),
    "min_p": SamplingParams(temperature=1.3, min_p=0.2),
}


def _tensors(params: SamplingParams) -> SamplingTensors:
    one = SamplingTensors.from_rows([SamplingRow(params, 0, [], [])], 1, V)
    many = SamplingTensors(*(np.repeat(np.asarray(f), ROWS, axis=0) for f in one))
    return many._replace(seed_words=np.array([_seed_words(s) for s in range(ROWS)], np.uint32))


def _pvalue(tokens: np.ndarray, probs: np.ndarray) -> float:
    observed = np.bincount(tokens, minlength=V)
    probs = np.asarray(probs, np.float64)
    keep = probs > 0
    assert observed[~keep].sum() == 0, "a token outside the truncated distribution was emitted"
    return chisquare(observed[keep], probs[keep] / probs[keep].sum() * len(tokens)).pvalue


@pytest.mark.parametrize("name", list(PARAMS))
def test_speculation_emits_what_sampling_draws(name):
    rng = np.random.default_rng(3)
    logits = np.broadcast_to(rng.standard_normal(V).astype(np.float32) * 0.7, (ROWS, V))
    tensors = _tensors(PARAMS[name])
    p = np.asarray(jax.jit(target_probs, static_argnums=2)(jnp.asarray(logits), tensors, V))[0]
    assert 1 < np.count_nonzero(p) < V if name != "temperature" else np.count_nonzero(p) == V  # truncation bites
    drawn = np.asarray(jax.jit(sample, static_argnums=2)(jnp.asarray(logits), tensors, V).token_ids)
    assert _pvalue(drawn, p) > 1e-3
    # a draft that knows nothing of the truncation proposes from its own distribution
    q = np.exp(rng.standard_normal((K, V))).astype(np.float32)
    q /= q.sum(-1, keepdims=True)
    proposals = (q.cumsum(-1)[None] < rng.random((ROWS, K, 1))).sum(-1).astype(np.int32)
    out = jax.jit(verify)(jnp.broadcast_to(jnp.asarray(p), (ROWS, K + 1, V)), jnp.asarray(proposals),
                          jnp.full(ROWS, K, jnp.int32), jnp.asarray(rng.random((ROWS, K)), jnp.float32),
                          jnp.asarray(rng.random((ROWS, K + 1)), jnp.float32), jnp.zeros(ROWS, bool),
                          jnp.broadcast_to(jnp.asarray(q), (ROWS, K, V)))
    assert _pvalue(np.asarray(out.tokens)[:, 0], p) > 1e-3


def test_greedy_rows_get_their_argmax_as_a_one_hot_target():
    logits = jnp.asarray(np.random.default_rng(4).standard_normal((2, V)), jnp.float32)
    rows = [SamplingRow(SamplingParams(temperature=0.0), 0, [], []), SamplingRow(SamplingParams(), 1, [], [])]
    p = np.asarray(target_probs(logits, SamplingTensors.from_rows(rows, 2, V), V))
    assert p[0].tolist() == np.eye(V)[int(np.argmax(logits[0]))].tolist()
    np.testing.assert_allclose(p[1], np.asarray(jax.nn.softmax(logits[1])), rtol=1e-5)
