"""Speculative verification is lossless: whatever the draft proposes, every emitted token is
distributed as the target alone would sample it (chi-square on 10^5 rows, p > 1e-3), and greedy rows
keep exactly the target's argmax prefix."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.stats import chisquare

from jaxserve.spec.rejection import verify

ROWS, K, V = 100_000, 3, 8
verify_jit = jax.jit(verify)


def _dists(rng, shape, peaked=1.0):
    logits = rng.standard_normal(shape) * peaked
    probs = np.exp(logits)
    probs[..., rng.integers(0, V)] = 0.0  # a token the distribution never takes
    return (probs / probs.sum(-1, keepdims=True)).astype(np.float32)


def _draw_np(rng, probs):
    cdf = probs.cumsum(-1)
    return (cdf < rng.random(probs.shape[:-1])[..., None] * cdf[..., -1:]).sum(-1).astype(np.int32)


def _chi2(tokens, probs):
    observed = np.bincount(tokens, minlength=V)
    probs = np.asarray(probs, np.float64)
    keep = probs > 0
    assert observed[~keep].sum() == 0, "a token of probability 0 was emitted"
    return chisquare(observed[keep], probs[keep] / probs[keep].sum() * len(tokens)).pvalue


def _run(rng, p_row, q_row=None, proposals=None):
    p = np.broadcast_to(p_row, (ROWS, K + 1, V))
    q = None if q_row is None else np.broadcast_to(q_row, (ROWS, K, V))
    if proposals is None:
        proposals = _draw_np(rng, q)                       # a draft samples its proposals from q
    out = verify_jit(jnp.asarray(p), jnp.asarray(proposals), jnp.full((ROWS,), K, jnp.int32),
                     jnp.asarray(rng.random((ROWS, K)), jnp.float32), jnp.asarray(rng.random((ROWS, K + 1)), jnp.float32),
                     jnp.zeros(ROWS, bool), None if q is None else jnp.asarray(q))
    return np.asarray(out.tokens), np.asarray(out.num_tokens), proposals


@pytest.mark.parametrize("draft", ["distribution", "one-hot"])
def test_emitted_tokens_follow_the_target_whatever_the_draft(draft):
    rng = np.random.default_rng(0)
    p_row = _dists(rng, (K + 1, V))
    if draft == "distribution":
        tokens, n, proposals = _run(rng, p_row, q_row=_dists(rng, (K, V), peaked=2.0))
    else:  # n-gram proposals: fixed tokens, no distribution; the second is a token p_1 never takes
        fixed = np.array([np.argmax(p_row[0]), np.argmin(p_row[1]), 3], np.int32)
        tokens, n, proposals = _run(rng, p_row, proposals=np.broadcast_to(fixed, (ROWS, K)))
        assert abs((n >= 2).mean() - p_row[0, fixed[0]]) < 0.01   # one-hot q: accepted with p(d)
        assert n.max() == 2                                        # p_1(d_1) = 0: never accepted
    assert _chi2(tokens[:, 0], p_row[0]) > 1e-3
    # the second emitted token, where the first proposal was accepted, follows p_1
    second = n >= 2
    assert np.all(tokens[second, 0] == proposals[second, 0])
    assert _chi2(tokens[second, 1], p_row[1]) > 1e-3


def test_the_draft_distribution_sets_the_acceptance_rate():
    rng = np.random.default_rng(1)
    p_row = _dists(rng, (K + 1, V))
    q_row = _dists(rng, (K, V), peaked=2.0)
    _, n, _ = _run(rng, p_row, q_row=q_row)
    assert abs((n >= 2).mean() - np.minimum(p_row[0], q_row[0]).sum()) < 0.01
    _, n_same, _ = _run(rng, p_row, q_row=p_row[:K])  # the target as its own draft: all accepted
    assert np.all(n_same == K + 1)


def test_greedy_rows_keep_the_argmax_prefix_and_rows_may_propose_fewer():
    p = np.zeros((4, K + 1, V), np.float32)
    best = np.array([[1, 2, 3, 4], [5, 5, 5, 5], [0, 7, 1, 2], [6, 6, 6, 6]])
    p[np.arange(4)[:, None], np.arange(K + 1)[None], best] = 0.9
    p += 0.1 / V
    proposals = np.array([[1, 2, 3], [5, 0, 5], [1, 7, 1], [6, 6, 6]], np.int32)
    num = np.array([3, 3, 3, 1], np.int32)
    out = verify_jit(jnp.asarray(p), jnp.asarray(proposals), jnp.asarray(num), jnp.zeros((4, K)),
                     jnp.zeros((4, K + 1)), jnp.ones(4, bool))
    n = np.asarray(out.num_tokens)
    assert n.tolist() == [4, 2, 1, 2]                       # all + bonus; 1 then fix; fix at 0; 1 proposed + bonus
    tokens = np.asarray(out.tokens)
    assert tokens[0].tolist() == [1, 2, 3, 4]
    assert tokens[1, :2].tolist() == [5, 5] and tokens[2, 0] == 0 and tokens[3, :2].tolist() == [6, 6]
    assert np.asarray(out.num_accepted).tolist() == [3, 1, 0, 1]
