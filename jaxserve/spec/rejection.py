"""Lossless verification of k proposed tokens per row against the target distribution, for proposals
that come with a draft distribution q (jnp, jittable). One-hot proposals (n-gram lookup) are served
through accept.py instead: the same rule for q one-hot, with the ordinary sampler.

Standard speculative sampling (Leviathan et al. 2023; Chen et al. 2023): proposal i of a row is
accepted with probability min(1, p_i(d_i) / q_i(d_i)), in order; at the first rejection the row
emits a token drawn from normalise(max(p_i - q_i, 0)) and stops; when all of its proposals are
accepted it emits a bonus token drawn from p_k. Every emitted token is then distributed exactly as
sampling from the target alone would give. `q` is the draft's distribution, or None for proposals
that come with none (n-gram lookup): q is then one-hot at the proposal, so acceptance is p_i(d_i)
and a rejection draws from p_i with d_i removed. Greedy rows accept while the proposal is the
target's argmax and emit the argmax at the first mismatch (and as the bonus).

`p` must be the target's processed distribution (penalties, temperature, top-k/top-p/min-p, grammar
mask applied) at each of the k + 1 positions; draws use caller-provided uniforms, so seeding stays
the sampler's business.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class Verified(NamedTuple):
    tokens: jax.Array      # [R, K+1] int32: accepted proposals, then the correction or bonus token
    num_tokens: jax.Array  # [R] int32 in [1, num_proposals + 1]: how many of `tokens` the row emits
    num_accepted: jax.Array  # [R] int32: accepted proposals (num_tokens - 1)


def _draw(probs: jax.Array, u: jax.Array) -> jax.Array:
    """Inverse-CDF draw from unnormalised probs [..., V] with uniforms u [...] in [0, 1)."""
    cdf = jnp.cumsum(probs, axis=-1)
    target = u * cdf[..., -1]
    return jnp.sum(cdf <= target[..., None], axis=-1).clip(0, probs.shape[-1] - 1).astype(jnp.int32)


def verify(p: jax.Array, proposals: jax.Array, num_proposals: jax.Array, u_accept: jax.Array,
           u_draw: jax.Array, greedy: jax.Array, q: jax.Array | None = None) -> Verified:
    """p: [R, K+1, V] target probabilities; proposals: [R, K] int32; num_proposals: [R] int32 (a row
    may propose fewer than K, or none); u_accept: [R, K], u_draw: [R, K+1] uniforms in [0, 1);
    greedy: [R] bool; q: [R, K, V] draft probabilities, or None for one-hot proposals."""
    r, k1, v = p.shape
    k = k1 - 1
    rows = jnp.arange(r)[:, None]
    pos = jnp.arange(k)[None, :]
    p_prop = jnp.take_along_axis(p[:, :k], proposals[..., None], axis=-1)[..., 0]          # [R, K]
    if q is None:
        q_prop = jnp.ones_like(p_prop)
        residual = p[:, :k].at[rows, pos, proposals].set(0.0)                              # p - onehot, clipped
    else:
        q_prop = jnp.take_along_axis(q, proposals[..., None], axis=-1)[..., 0]
        residual = jnp.maximum(p[:, :k] - q, 0.0)
    argmax = jnp.argmax(p, axis=-1).astype(jnp.int32)                                      # [R, K+1]
    ok = jnp.where(greedy[:, None], proposals == argmax[:, :k],
                   u_accept * q_prop < p_prop)                                             # u < p/q, no division
    ok &= pos < num_proposals[:, None]
    accepted = jnp.argmin(jnp.concatenate([ok, jnp.zeros((r, 1), bool)], axis=1), axis=1).astype(jnp.int32)
    # the token after the accepted run: a draw from the residual at a rejection, from p at the bonus
    # position (all proposals accepted); a residual with no mass (p == q there) falls back to p
    at = accepted
    res_at = jnp.take_along_axis(jnp.concatenate([residual, p[:, k:]], axis=1), at[:, None, None], axis=1)[:, 0]
    bonus = at >= num_proposals
    p_at = jnp.take_along_axis(p, at[:, None, None], axis=1)[:, 0]
    dist = jnp.where((bonus | (res_at.sum(-1) <= 0))[:, None], p_at, res_at)
    u_at = jnp.take_along_axis(u_draw, at[:, None], axis=1)[:, 0]
    last = jnp.where(greedy, jnp.take_along_axis(argmax, at[:, None], axis=1)[:, 0], _draw(dist, u_at))
    tokens = jnp.concatenate([proposals, jnp.zeros((r, 1), jnp.int32)], axis=1)
    tokens = jnp.where(jnp.arange(k1)[None, :] == at[:, None], last[:, None], tokens)
    return Verified(tokens=tokens, num_tokens=at + 1, num_accepted=at)
