"""Gated DeltaNet linear attention (the linear layers of Qwen3-Next / Qwen3.5) in pure jnp.

The recurrence, per value head, with a state S [Dk, Dv] and per token t:

    S   <- exp(g_t) * S                          g_t <= 0: log of the per-step decay
    u_t  = beta_t * (v_t - S^T k_t)              the delta rule: write only what S mispredicts
    S   <- S + k_t u_t^T
    o_t  = S^T q_t                               q_t already multiplied by `scale`

Conventions (those of transformers' `torch_recurrent_gated_delta_rule` / `..._chunk_...`):
q and k are cast to float32, l2-normalized when `qk_l2norm` (x * rsqrt(sum(x^2) + 1e-6)), then q is
multiplied by `scale` (default Dk ** -0.5); everything accumulates in float32; outputs come back in
q's dtype, states always in float32. Fewer q/k heads than value heads (Qwen3-Next: 16 and 32) is
grouped attention: key head h serves value heads h*G .. h*G+G-1 (repeat_interleave, G = Hv // Hk).

The chunk-parallel form (WY representation, UT transform): inside a chunk of C tokens with
cumulative log decay c_t (Gamma_t = exp(c_t)), the corrections u solve the unit lower-triangular
system (I + A) u = beta*v - Gamma*beta*k S0 with A_ij = beta_i (k_i.k_j) Gamma_i/Gamma_j (j < i);
then o = Gamma*q S0 + P u with P_ij = (q_i.k_j) Gamma_i/Gamma_j (j <= i), and the state leaves the
chunk as Gamma_C S0 + sum_j (Gamma_C/Gamma_j) k_j u_j^T. Only exp of non-positive numbers is taken.

Ragged batches (`ragged_gated_delta`): sequences of one token (a decode step's rows) run first, all
together, as one batched recurrent step over [S, H, Dk, Dv]. The tokens of the longer sequences are
split into per-sequence chunk *slots* (a sequence of length L owns ceil(L / C) slots; a slot never mixes sequences), and one
`fori_loop` with a dynamic trip count (the number of live slots) walks them. Each slot reads its
sequence's state from the running `[S, H, Dk, Dv]` buffer, runs, and writes it back, so chunked
prefill continues across slots and calls. A slot with at most `recurrent_max` tokens (decode rows,
short tails) runs the token recurrence under `lax.cond`, costing what its decode steps cost; longer
slots run the chunk form. Why not the alternatives: gathering into [S, Tmax] padded rows makes a
batch of 64 decodes next to one 2048-token prefill cost 64 prefills; a token-level segmented scan
is correct but runs every prefill token as a sequential rank-1 update (the slow path); the chunk
form on a slot of one real token does C tokens of work. The slots walk one after the other: fine on
CPU (each slot's matmuls are [H, C, D]-sized), a Pallas kernel would instead grid over them.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

_HI = lax.Precision.HIGHEST  # a reference: float32 matmuls at IEEE precision on every backend
L2NORM_EPS = 1e-6  # transformers' l2norm (matches the FLA kernels): x * rsqrt(sum(x * x) + eps)
_F32 = jnp.float32


def _l2norm(x: jax.Array) -> jax.Array:
    return x * lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2NORM_EPS)


def _check(q, k, v, g, beta, state) -> None:
    if q.shape != k.shape or q.ndim != 3 or v.ndim != 3 or q.shape[0] != v.shape[0]:
        raise ValueError(f"q, k must be [T, Hk, Dk] and v [T, Hv, Dv]: {q.shape} {k.shape} {v.shape}")
    t, hk, dk = q.shape
    hv, dv = v.shape[1:]
    if hv % hk:
        raise ValueError(f"value heads {hv} must be a multiple of key heads {hk}")
    if g.shape != (t, hv) or beta.shape != (t, hv):
        raise ValueError(f"g and beta must be [T, Hv] = {(t, hv)}: {g.shape} {beta.shape}")
    if state.shape[-3:] != (hv, dk, dv):
        raise ValueError(f"state must end in [Hv, Dk, Dv] = {(hv, dk, dv)}: {state.shape}")


def _prepare(q, k, v, g, beta, qk_l2norm: bool, scale: float | None):
    """float32, token-major: q, k [T, Hv, Dk] (normalized, q scaled), v [T, Hv, Dv], g, beta [T, Hv]."""
    qf, kf = q.astype(_F32), k.astype(_F32)
    if qk_l2norm:
        qf, kf = _l2norm(qf), _l2norm(kf)
    qf = qf * (q.shape[-1] ** -0.5 if scale is None else scale)
    groups = v.shape[1] // k.shape[1]
    if groups > 1:  # normalized before the repeat: the same numbers, G times less work
        qf, kf = jnp.repeat(qf, groups, axis=1), jnp.repeat(kf, groups, axis=1)
    return qf, kf, v.astype(_F32), g.astype(_F32), beta.astype(_F32)


def _recurrent_step(state, q, k, v, g, beta):
    """One token. state [H, Dk, Dv]; q, k [H, Dk]; v [H, Dv]; g, beta [H] -> (o [H, Dv], state)."""
    state = state * jnp.exp(g)[:, None, None]
    predicted = jnp.einsum("hk,hkv->hv", k, state, precision=_HI)  # S^T k: what S recalls for k
    u = (v - predicted) * beta[:, None]
    state = state + k[:, :, None] * u[:, None, :]
    return jnp.einsum("hk,hkv->hv", q, state, precision=_HI), state


def _unit_lower_inverse(a: jax.Array) -> jax.Array:
    """(I + A)^-1 for strictly lower triangular A [..., C, C], by forward substitution on rows.

    X = (I + A)^-1 - I is strictly lower with X_i = -A_i - sum_{j<i} A_ij X_j: row i needs only
    rows j < i, finished earlier in the loop. Measured on XLA:CPU (C=64, 1024 systems, 256 right-hand
    sides), forming X this way then one matmul beat lax.linalg.triangular_solve by ~1.3x at the same
    accuracy, and it needs no triangular-solve primitive (a Pallas port can reuse it).
    """
    c = a.shape[-1]

    def row(i, x):
        xi = x[..., i, :]  # [..., C]: -A_i, zero from column i on
        return x.at[..., i, :].set(xi + jnp.einsum("...j,...jk->...k", xi, x, precision=_HI))

    return lax.fori_loop(1, c, row, -a) + jnp.eye(c, dtype=a.dtype)


def _chunk_prepare(q, k, v, g, beta):
    """The state-independent part of one chunk, head-major: q, k [H, C, Dk]; v [H, C, Dv]; g, beta [H, C]."""
    c = g.shape[-1]
    cum = jnp.cumsum(g, axis=-1)  # [H, C]: log of the decay from the chunk start through token t
    idx = jnp.arange(c)
    causal = idx[:, None] >= idx[None, :]  # [C, C]: row i sees column j <= i
    diff = cum[:, :, None] - cum[:, None, :]  # [H, C, C]: log(Gamma_i / Gamma_j), <= 0 where causal
    decay = jnp.where(causal, jnp.exp(jnp.where(causal, diff, 0.0)), 0.0)  # no exp of positives
    kb = k * beta[..., None]
    a = jnp.einsum("hid,hjd->hij", kb, k, precision=_HI) * decay
    a = jnp.where(idx[:, None] > idx[None, :], a, 0.0)  # [H, C, C] strictly lower: I + A is unit lower
    gamma = jnp.exp(cum)  # [H, C]
    rhs = jnp.concatenate([v * beta[..., None], kb * gamma[..., None]], axis=-1)  # [H, C, Dv + Dk]
    sol = jnp.einsum("hij,hjd->hid", _unit_lower_inverse(a), rhs, precision=_HI)
    dv = v.shape[-1]
    u0, w = sol[..., :dv], sol[..., dv:]  # u = u0 - w @ S0 (the WY factors)
    attn = jnp.einsum("hid,hjd->hij", q, k, precision=_HI) * decay  # [H, C, C], diagonal included
    q_dec = q * gamma[..., None]  # reads S0 decayed to token i
    k_dec = k * jnp.exp(cum[:, -1:] - cum)[..., None]  # writes decayed to the chunk end
    return u0, w, attn, q_dec, k_dec, gamma[:, -1]


def _chunk_apply(state, prep):
    """state [H, Dk, Dv] -> (o [H, C, Dv], state after the chunk)."""
    u0, w, attn, q_dec, k_dec, gamma_end = prep
    u = u0 - jnp.einsum("hck,hkv->hcv", w, state, precision=_HI)
    out = (jnp.einsum("hck,hkv->hcv", q_dec, state, precision=_HI)
           + jnp.einsum("hij,hjv->hiv", attn, u, precision=_HI))
    state = gamma_end[:, None, None] * state + jnp.einsum("hck,hcv->hkv", k_dec, u, precision=_HI)
    return out, state


def gated_delta_recurrent(
    q: jax.Array,  # [T, Hk, Dk]
    k: jax.Array,  # [T, Hk, Dk]
    v: jax.Array,  # [T, Hv, Dv]
    g: jax.Array,  # [T, Hv] log decay, <= 0
    beta: jax.Array,  # [T, Hv]
    state: jax.Array,  # [Hv, Dk, Dv]
    *,
    qk_l2norm: bool = True,
    scale: float | None = None,
) -> tuple[jax.Array, jax.Array]:
    """One sequence, token by token (lax.scan). Returns (out [T, Hv, Dv] in q's dtype, state f32)."""
    _check(q, k, v, g, beta, state)

    def body(s, xs):
        o, s = _recurrent_step(s, *xs)
        return s, o

    final, out = lax.scan(body, state.astype(_F32), _prepare(q, k, v, g, beta, qk_l2norm, scale))
    return out.astype(q.dtype), final


def gated_delta_chunked(
    q: jax.Array,  # [T, Hk, Dk]
    k: jax.Array,  # [T, Hk, Dk]
    v: jax.Array,  # [T, Hv, Dv]
    g: jax.Array,  # [T, Hv]
    beta: jax.Array,  # [T, Hv]
    state: jax.Array,  # [Hv, Dk, Dv]
    *,
    chunk: int = 64,
    qk_l2norm: bool = True,
    scale: float | None = None,
) -> tuple[jax.Array, jax.Array]:
    """`gated_delta_recurrent` in the chunk-parallel form, a scan over chunks of `chunk` tokens.

    Each step forms its chunk's [C, C] matrices and WY factors, then reads and updates the state
    once. Preparing every chunk up front (vmap) instead was no faster on XLA:CPU and holds
    [T / C, H, C, C] intermediates (~270 MB per matrix at T=32K, H=32). T is padded to a multiple of
    `chunk` with beta = g = 0 tokens, which leave the state as it is."""
    _check(q, k, v, g, beta, state)
    t, hv, dv = v.shape
    if t == 0:
        return jnp.zeros(v.shape, q.dtype), state.astype(_F32)
    n = -(-t // chunk)
    pad = n * chunk - t

    def chunks(x):  # [T, H, ...] -> [N, H, C, ...]: head-major inside a chunk for batched matmuls
        x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))
        return jnp.moveaxis(x.reshape((n, chunk) + x.shape[1:]), 1, 2)

    xs = tuple(chunks(x) for x in _prepare(q, k, v, g, beta, qk_l2norm, scale))

    def body(s, x):  # the [C, C] work inside the scan: only one chunk's matrices live at a time
        o, s = _chunk_apply(s, _chunk_prepare(*x))
        return s, o

    final, out = lax.scan(body, state.astype(_F32), xs)  # out [N, H, C, Dv]
    out = jnp.moveaxis(out, 1, 2).reshape(n * chunk, hv, dv)[:t]
    return out.astype(q.dtype), final


def ragged_gated_delta(
    q: jax.Array,  # [T, Hk, Dk] tokens of all sequences, packed
    k: jax.Array,  # [T, Hk, Dk]
    v: jax.Array,  # [T, Hv, Dv]
    g: jax.Array,  # [T, Hv]
    beta: jax.Array,  # [T, Hv]
    states: jax.Array,  # [S, Hv, Dk, Dv] each sequence's state before these tokens
    seq_starts: jax.Array,  # [S] int32 first token of each sequence
    seq_lens: jax.Array,  # [S] int32 its token count (0: the state passes through)
    *,
    chunk: int = 64,
    qk_l2norm: bool = True,
    scale: float | None = None,
    recurrent_max: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """A ragged batch (module docstring: the slot walk). Sequences must not overlap and must lie in
    [0, T) (seq_starts + seq_lens <= T); any order. Tokens of no sequence get zeros. Returns
    (out [T, Hv, Dv] in q's dtype, new states [S, Hv, Dk, Dv] float32). Jittable: T, S static.

    Slots of at most `recurrent_max` tokens (default chunk // 2) run token by token: on XLA:CPU
    (Qwen3-Next shapes, chunk 64) 16 and 32-token slots ran 1.4x faster that way than in the chunk
    form, which pays for all C rows; full slots were about even. One-token sequences skip the walk:
    one batched step updates them all (64 decode rows at Qwen3-Next shapes: docs/BENCHMARKS.md)."""
    _check(q, k, v, g, beta, states)
    t, hv, dv = v.shape
    c = chunk
    recurrent_max = c // 2 if recurrent_max is None else recurrent_max
    # C extra zero rows: a C-row slice at any token start stays in bounds (dynamic_slice would
    # otherwise clamp the start and read the wrong rows).
    xs = tuple(jnp.pad(x, [(0, c)] + [(0, 0)] * (x.ndim - 1))
               for x in _prepare(q, k, v, g, beta, qk_l2norm, scale))
    lens = jnp.maximum(seq_lens.astype(jnp.int32), 0)
    starts = seq_starts.astype(jnp.int32)
    # one-token sequences: a batched recurrent step, each reading its token's row
    single = lens == 1
    row = jnp.where(single, starts, t)  # the others read a zero pad row (their result is discarded)
    o1, s1 = jax.vmap(_recurrent_step)(states.astype(_F32), *(x[row] for x in xs))  # [S, Hv, Dv], [S, Hv, Dk, Dv]
    states = jnp.where(single[:, None, None, None], s1, states.astype(_F32))
    lens = jnp.where(single, 0, lens)  # left out of the slot walk
    slots = (lens + c - 1) // c  # [S] slots per sequence
    slot_end = jnp.cumsum(slots)  # [S] inclusive: slots of sequence s are [end - slots, end)
    rows = jnp.arange(c)

    # The branches read their inputs themselves (a decode row reads one row, not C: 64 decode rows at
    # Qwen3-Next shapes went from ~190 to ~150 ms); the big buffers stay out of the cond (passing them
    # through it made XLA:CPU copy them per slot, ~10x slower).
    def recurrent(state, start, n):  # n tokens one by one: a decode row costs one step
        def step(i, carry):
            s, o = carry
            oi, s = _recurrent_step(s, *(lax.dynamic_index_in_dim(a, start + i, 0, False) for a in xs))
            return s, o.at[i].set(oi)

        state, o = lax.fori_loop(0, n, step, (state, jnp.zeros((c, hv, dv), _F32)))
        return o, state

    def chunked(state, start, n):
        valid = rows < n  # rows past n belong to the next sequence (or padding): beta = g = 0
        x = [lax.dynamic_slice_in_dim(a, start, c, 0) for a in xs]
        x = [jnp.where(valid.reshape((c,) + (1,) * (a.ndim - 1)), a, 0.0) for a in x]
        o, state = _chunk_apply(state, _chunk_prepare(*(jnp.moveaxis(a, 0, 1) for a in x)))
        return jnp.moveaxis(o, 1, 0), state

    def body(j, carry):
        out, st = carry  # out [T + C, Hv, Dv] f32; st [S, Hv, Dk, Dv] f32
        s = jnp.searchsorted(slot_end, j, side="right")  # the sequence owning slot j
        local = j - (slot_end[s] - slots[s])  # slot index inside the sequence
        start = starts[s] + local * c
        n = jnp.minimum(c, lens[s] - local * c)  # live rows in this slot, 1..C
        o, new = lax.cond(n <= recurrent_max, recurrent, chunked,
                          lax.dynamic_index_in_dim(st, s, 0, keepdims=False), start, n)
        old = lax.dynamic_slice_in_dim(out, start, c, 0)  # keep rows this slot does not own
        out = lax.dynamic_update_slice_in_dim(out, jnp.where((rows < n)[:, None, None], o, old), start, 0)
        return out, lax.dynamic_update_index_in_dim(st, new, s, 0)

    out0 = jnp.zeros((t + c, hv, dv), _F32).at[row].set(o1, mode="drop")  # row t: a pad row, then sliced off
    out, new_states = lax.fori_loop(0, slot_end[-1], body, (out0, states))
    return out[:t].astype(q.dtype), new_states


def _activate(y: jax.Array, activation: str | None) -> jax.Array:
    if activation is None:
        return y
    if activation in ("silu", "swish"):
        return jax.nn.silu(y)
    raise ValueError(f"unsupported activation {activation!r}")


def causal_conv1d(
    x: jax.Array,  # [T, C] this sequence's new inputs
    conv_state: jax.Array,  # [K-1, C] the previous K-1 inputs (zeros for a fresh sequence)
    weight: jax.Array,  # [C, K] depthwise taps (HF's conv1d.weight [C, 1, K] squeezed)
    bias: jax.Array | None = None,  # [C]
    activation: str | None = "silu",
) -> tuple[jax.Array, jax.Array]:
    """Causal depthwise conv: y_t = act(bias + sum_k weight[:, k] * h[t + k]) over h = state ++ x,
    so tap K-1 weighs the current token. Returns (y [T, C] in x's dtype, the last K-1 rows of h)."""
    t = x.shape[0]
    kk = weight.shape[1]
    if conv_state.shape != (kk - 1, x.shape[1]):
        raise ValueError(f"conv_state must be [K-1, C] = {(kk - 1, x.shape[1])}: {conv_state.shape}")
    h = jnp.concatenate([conv_state.astype(_F32), x.astype(_F32)], axis=0)  # [K-1+T, C]
    w = weight.astype(_F32)
    y = sum(w[:, i] * h[i:i + t] for i in range(kk))  # K static (4): K shifted multiply-adds
    if bias is not None:
        y = y + bias.astype(_F32)
    hist = jnp.concatenate([conv_state, x.astype(conv_state.dtype)], axis=0)
    return _activate(y, activation).astype(x.dtype), hist[hist.shape[0] - (kk - 1):]


def token_to_seq(seq_starts: jax.Array, seq_lens: jax.Array, num_tokens: int) -> tuple[jax.Array, jax.Array]:
    """(sequence of each token [T] int32, token lies in a sequence [T] bool), sequences in any order.

    Sorted by start (empty sequences last, so they never claim a token), the candidate for token t
    is the last sequence starting at or before t; it owns t if t < its end."""
    key = jnp.where(seq_lens > 0, seq_starts, jnp.iinfo(jnp.int32).max).astype(jnp.int32)
    order = jnp.argsort(key)
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    pos = jnp.searchsorted(key[order], t, side="right") - 1  # [T] in [-1, S-1]
    seq = order[jnp.maximum(pos, 0)].astype(jnp.int32)
    live = (pos >= 0) & (t < seq_starts[seq] + seq_lens[seq])
    return seq, live


def ragged_causal_conv1d(
    x: jax.Array,  # [T, C] packed tokens
    conv_states: jax.Array,  # [S, K-1, C]
    seq_starts: jax.Array,  # [S] int32
    seq_lens: jax.Array,  # [S] int32
    weight: jax.Array,  # [C, K]
    bias: jax.Array | None = None,  # [C]
    activation: str | None = "silu",
) -> tuple[jax.Array, jax.Array]:
    """`causal_conv1d` per sequence of a ragged batch. Returns (y [T, C], new conv states [S, K-1, C]);
    tokens of no sequence get zeros, empty sequences keep their state."""
    t, ch = x.shape
    kk = weight.shape[1]
    km1 = kk - 1
    if conv_states.shape[1:] != (km1, ch):
        raise ValueError(f"conv_states must be [S, K-1, C] = [S, {km1}, {ch}]: {conv_states.shape}")
    seq, live = token_to_seq(seq_starts, seq_lens, t)
    pos = jnp.arange(t, dtype=jnp.int32) - seq_starts[seq]  # [T] position inside its sequence
    xf, w, sf = x.astype(_F32), weight.astype(_F32), conv_states.astype(_F32)
    y = w[:, km1] * xf  # tap K-1: the token itself
    for i in range(km1):  # tap i reads d = K-1-i tokens back: x, or the state before the sequence
        d = km1 - i
        back = jnp.pad(xf, [(d, 0), (0, 0)])[:t]  # x[t - d]
        from_state = sf[seq, jnp.clip(pos + i, 0, km1 - 1)]  # h[pos + i] = state row pos + i
        y = y + w[:, i] * jnp.where((pos >= d)[:, None], back, from_state)
    if bias is not None:
        y = y + bias.astype(_F32)
    y = jnp.where(live[:, None], _activate(y, activation), 0.0).astype(x.dtype)
    # new state row r = h[L + r] over h = state ++ x: the state while L + r < K-1, else x
    lens = jnp.maximum(seq_lens, 0).astype(jnp.int32)
    idx = lens[:, None] + jnp.arange(km1, dtype=jnp.int32)[None, :]  # [S, K-1]
    from_x = x[jnp.clip(seq_starts[:, None] + idx - km1, 0, max(t - 1, 0))].astype(conv_states.dtype)
    from_state = jnp.take_along_axis(conv_states, jnp.clip(idx, 0, max(km1 - 1, 0))[..., None], axis=1)
    new_states = jnp.where((idx >= km1)[..., None], from_x, from_state)
    return y, new_states
