"""kernels_pallas/gated_delta_reference.py against transformers' Qwen3-Next torch reference and
against itself (recurrent vs chunked vs ragged), plus the causal depthwise conv."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_next import modeling_qwen3_next as hf

from kernels_pallas.gated_delta_reference import (
    causal_conv1d,
    gated_delta_chunked,
    gated_delta_recurrent,
    ragged_causal_conv1d,
    ragged_gated_delta,
)

TOL = dict(rtol=1e-5, atol=2e-5)
DK, DV = 16, 8


def _inputs(seed, t, hk=2, hv=4, dk=DK, dv=DV):
    """q, k [T, Hk, Dk], v [T, Hv, Dv], g, beta [T, Hv] as the model makes them, float32 numpy."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((t, hk, dk)).astype(np.float32)
    k = rng.standard_normal((t, hk, dk)).astype(np.float32)
    q[::5] *= 1e-3  # |q|^2 near the l2norm eps (1e-6): pins the eps convention
    k[1::7] *= 1e-3
    v = rng.standard_normal((t, hv, dv)).astype(np.float32)
    a_log = np.log(rng.uniform(0.5, 8, hv))  # g = -exp(A_log) * softplus(a + dt_bias), as in the layer
    g = (-np.exp(a_log) * np.logaddexp(0, rng.standard_normal((t, hv)) - 2)).astype(np.float32)
    beta = (1 / (1 + np.exp(-rng.standard_normal((t, hv))))).astype(np.float32)
    return q, k, v, g, beta


def _state(seed, s=None, hv=4, dk=DK, dv=DV):
    shape = (hv, dk, dv) if s is None else (s, hv, dk, dv)
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * 0.5


def _hf(fn, q, k, v, g, beta, state, **kw):
    """transformers' torch function on a batch of one; returns numpy (out [T, H, Dv], state)."""
    tt = [torch.from_numpy(x)[None] for x in (q, k, v, g, beta)]
    init = None if state is None else torch.from_numpy(state)[None]
    out, final = fn(*tt, initial_state=init, output_final_state=True, use_qk_l2norm_in_kernel=True, **kw)
    return out[0].numpy(), final[0].numpy()


recurrent = jax.jit(gated_delta_recurrent)
chunked = jax.jit(gated_delta_chunked, static_argnames=("chunk",))
ragged = jax.jit(ragged_gated_delta, static_argnames=("chunk", "recurrent_max"))


@pytest.mark.parametrize("with_state", [False, True])
def test_recurrent_matches_transformers(with_state):
    x = _inputs(0, 37)
    s0 = _state(1) if with_state else None
    want_o, want_s = _hf(hf.torch_recurrent_gated_delta_rule, *x, s0)
    out, final = recurrent(*x, np.zeros((4, DK, DV), np.float32) if s0 is None else s0)
    np.testing.assert_allclose(out, want_o, **TOL)
    np.testing.assert_allclose(final, want_s, **TOL)


def test_chunked_matches_transformers_chunk_form():
    x = _inputs(2, 45)
    s0 = _state(3)
    want_o, want_s = _hf(hf.torch_chunk_gated_delta_rule, *x, s0, chunk_size=16)
    out, final = chunked(*x, s0, chunk=16)
    np.testing.assert_allclose(out, want_o, **TOL)
    np.testing.assert_allclose(final, want_s, **TOL)


@pytest.mark.parametrize("t,chunk", [(1, 16), (5, 16), (37, 16), (64, 16), (100, 32), (70, 64)])
def test_chunked_matches_recurrent(t, chunk):
    x = _inputs(t, t)
    s0 = _state(t + 1)
    want_o, want_s = recurrent(*x, s0)
    out, final = chunked(*x, s0, chunk=chunk)
    np.testing.assert_allclose(out, want_o, **TOL)
    np.testing.assert_allclose(final, want_s, **TOL)


def test_dtypes_and_equal_head_counts():
    q, k, v, g, beta = _inputs(4, 9, hk=4)
    out, final = chunked(*(jnp.asarray(a, jnp.bfloat16) for a in (q, k, v)), g, beta,
                         jnp.zeros((4, DK, DV), jnp.bfloat16), chunk=16)
    assert out.dtype == jnp.bfloat16 and final.dtype == jnp.float32
    want_o, want_s = _hf(hf.torch_recurrent_gated_delta_rule, q, k, v, g, beta, None)
    out, final = recurrent(q, k, v, g, beta, np.zeros((4, DK, DV), np.float32))
    np.testing.assert_allclose(out, want_o, **TOL)
    np.testing.assert_allclose(final, want_s, **TOL)


def _per_sequence(x, states, starts, lens, t):
    """The ragged result built from one recurrent call per sequence."""
    out = np.zeros((t, 4, DV), np.float32)
    new = np.array(states)
    for s, (b, n) in enumerate(zip(starts, lens)):
        if n:
            o, new[s] = recurrent(*(a[b:b + n] for a in x), states[s])
            out[b:b + n] = o
    return out, new


# Lengths 0 and 1 (decode rows), 9 (one partial chunk), 23 = 16 + 7, 40 = 16 + 16 + 8; out of
# order, with a gap and unused tokens at the end.
STARTS = [30, 0, 5, 0, 29, 70, 61]
LENS = [23, 1, 9, 0, 1, 0, 0]
T_RAGGED = 75


@pytest.mark.parametrize("recurrent_max", [0, 8, 64])  # all chunk form / mixed / all recurrent
def test_ragged_matches_per_sequence_calls(recurrent_max):
    starts, lens = list(STARTS), list(LENS)
    starts[5], lens[5] = 53, 17  # seq 5: 53..69; 14..28 and 70..74 belong to no sequence
    starts[6], lens[6] = 14, 0
    x = _inputs(5, T_RAGGED)
    states = _state(6, s=7)
    want_o, want_s = _per_sequence(x, states, starts, lens, T_RAGGED)
    out, new = ragged(*x, states, np.array(starts, np.int32), np.array(lens, np.int32),
                      chunk=16, recurrent_max=recurrent_max)
    np.testing.assert_allclose(out, want_o, **TOL)
    np.testing.assert_allclose(new, want_s, **TOL)
    assert not np.any(np.asarray(out)[14:29]) and not np.any(np.asarray(out)[70:])
    np.testing.assert_array_equal(new[3], states[3])  # empty sequences keep their state exactly


def test_ragged_chunked_prefill_then_decode_continues_state():
    # Sequence A's 40-token prompt in one call == 13 tokens, then 27 next to a decode row of B,
    # then one decode token each.
    x = _inputs(7, 42)
    states = _state(8, s=2)
    one_o, one_s = _per_sequence(x, states, [0, 40], [40, 2], 42)
    piece = lambda lo, hi: tuple(a[lo:hi] for a in x)  # noqa: E731
    o1, s1 = ragged(*piece(0, 13), states, np.array([0, 13], np.int32), np.array([13, 0], np.int32),
                    chunk=16)
    # step 2 packs A's tokens 13..39 and B's first token (global 40)
    x2 = tuple(np.concatenate([a[13:40], a[40:41]]) for a in x)
    o2, s2 = ragged(*x2, s1, np.array([0, 27], np.int32), np.array([27, 1], np.int32), chunk=16)
    # step 3: A decodes a token (reusing global row 41's inputs), B its second (global 41)
    x3 = tuple(np.concatenate([a[41:42], a[41:42]]) for a in x)
    o3, s3 = ragged(*x3, s2, np.array([0, 1], np.int32), np.array([1, 1], np.int32), chunk=16)
    np.testing.assert_allclose(np.concatenate([o1, o2[:27]]), one_o[:40], **TOL)
    np.testing.assert_allclose(np.concatenate([o2[27:], o3[1:]]), one_o[40:42], **TOL)
    np.testing.assert_allclose(s3[1], one_s[1], **TOL)
    want_a, want_sa = recurrent(*piece(41, 42), one_s[0])
    np.testing.assert_allclose(o3[:1], want_a, **TOL)
    np.testing.assert_allclose(s3[0], want_sa, **TOL)


K, C = 4, 6


def _conv_inputs(seed, t, s=None):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((t, C)).astype(np.float32)
    shape = (K - 1, C) if s is None else (s, K - 1, C)
    state = rng.standard_normal(shape).astype(np.float32)
    return x, state, rng.standard_normal((C, K)).astype(np.float32), rng.standard_normal(C).astype(np.float32)


def _torch_conv(x, state, weight, bias):
    """Depthwise conv1d of torch over state ++ x (channels first), silu, the last T outputs."""
    h = torch.from_numpy(np.concatenate([state, x]).T)[None]  # [1, C, K-1+T]
    y = F.silu(F.conv1d(h, torch.from_numpy(weight)[:, None], torch.from_numpy(bias), groups=C))
    return y[0].T.numpy()[-x.shape[0]:]


@pytest.mark.parametrize("t", [1, 2, 11])
def test_conv_matches_torch_depthwise_conv(t):
    x, state, w, b = _conv_inputs(t, t)
    y, new = causal_conv1d(x, state, w, b)
    np.testing.assert_allclose(y, _torch_conv(x, state, w, b), **TOL)
    np.testing.assert_array_equal(new, np.concatenate([state, x])[-(K - 1):])
    # a fresh sequence (zero state) is transformers' prefill path: conv1d with K-1 zeros of padding
    want = hf.causal_conv1d_fn(torch.from_numpy(x.T)[None], torch.from_numpy(w), torch.from_numpy(b),
                               activation="silu")
    np.testing.assert_allclose(causal_conv1d(x, np.zeros_like(state), w, b)[0], want[0].T.numpy(), **TOL)


def test_conv_decode_steps_continue_one_long_call():
    x, state, w, b = _conv_inputs(20, 9)
    y_all, s_all = causal_conv1d(x, state, w, None, activation=None)
    s = state
    for i in range(9):
        y, s = causal_conv1d(x[i:i + 1], s, w, None, activation=None)
        np.testing.assert_allclose(y, y_all[i:i + 1], **TOL)
    np.testing.assert_array_equal(s, s_all)


def test_ragged_conv_matches_per_sequence_calls():
    starts, lens = [12, 0, 1, 4, 30], [15, 1, 2, 0, 1]  # 3..11, 27..29, 31 in no sequence
    x, states, w, b = _conv_inputs(30, 32, s=5)
    y, new = jax.jit(ragged_causal_conv1d)(x, states, np.array(starts, np.int32),
                                           np.array(lens, np.int32), w, b)
    want_y = np.zeros_like(x)
    for s, (st, n) in enumerate(zip(starts, lens)):
        want_y[st:st + n], want_s = causal_conv1d(x[st:st + n], states[s], w, b)
        np.testing.assert_array_equal(new[s], want_s)
    np.testing.assert_allclose(y, want_y, **TOL)
