"""The unpaged parity path: full-sequence forward over a left-padded [B, S] batch.

This is the numerical reference for everything paged: no cache, plain causal (and sliding-window)
masked softmax, positions derived from the attention mask exactly as transformers' `generate` does
for left padding. `greedy_generate` re-runs the full forward at a fixed padded length each step,
so it compiles once and has no cache logic that could hide a bug.
"""

from __future__ import annotations

from functools import partial
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.core.config import ModelConfig
from kernels_pallas.gated_delta_reference import causal_conv1d, gated_delta_chunked
from jaxserve.model.lora import LoraInputs
from jaxserve.model.transformer import forward
from jaxserve.model.weights import Weights


def dense_attention(q: jax.Array, k: jax.Array, v: jax.Array, key_valid: jax.Array,
                    window: int | None, scale: float, soft_cap: float | None = None,
                    sinks: jax.Array | None = None) -> jax.Array:
    """q: [B, S, Hq, hd]; k, v: [B, S, Hkv, hd]; key_valid: [B, S] bool; sinks: [Hq] (a logit per
    head in the softmax's denominator only) -> [B, S, Hq, hd]."""
    b, s, hq, hd = q.shape
    hkv = k.shape[2]
    qg = q.reshape(b, s, hkv, hq // hkv, hd).astype(jnp.float32)
    scores = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k.astype(jnp.float32)) * scale
    if soft_cap is not None:
        scores = jnp.tanh(scores / soft_cap) * soft_cap
    qi = jnp.arange(s)[:, None]
    ki = jnp.arange(s)[None, :]
    allowed = ki <= qi
    if window is not None:
        allowed &= (qi - ki) < window
    allowed = allowed[None] & key_valid[:, None, :]  # [B, Sq, Sk]
    scores = jnp.where(allowed[:, None, None], scores, -jnp.inf)
    # Rows with no allowed key (left padding queries) would be NaN; give them zeros instead.
    scores = jnp.where(allowed.any(-1)[:, None, None, :, None], scores, 0.0)
    if sinks is not None:  # one more column, dropped after the softmax: it only takes mass
        sink = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(1, hkv, hq // hkv, 1, 1), (*scores.shape[:-1], 1))
        probs = jax.nn.softmax(jnp.concatenate([scores, sink], axis=-1), axis=-1)[..., :-1]
    else:
        probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bhgqk,bkhd->bqhgd", probs, v.astype(jnp.float32))
    return out.reshape(b, s, hq, hd)


class DenseMixer:
    """A hybrid stack's linear layers over the left-padded batch: each row from a zero state. The
    conv's inputs at padding are zeroed (as transformers does), so a padded row's q, k and v there
    are zero and its state stays zero until its first token."""

    def __init__(self, cfg: ModelConfig, key_valid: jax.Array) -> None:
        self.cfg, self.key_valid = cfg, key_valid  # [B, S] bool

    def conv(self, i: int, x: jax.Array, weight: jax.Array) -> jax.Array:
        x = jnp.where(self.key_valid[..., None], x, 0)
        start = jnp.zeros((weight.shape[1] - 1, x.shape[-1]), x.dtype)
        return jax.vmap(lambda row: causal_conv1d(row, start, weight)[0])(x)

    def delta(self, i: int, q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array) -> jax.Array:
        lin = self.cfg.linear
        start = jnp.zeros((lin.num_v_heads, lin.k_head_dim, lin.v_head_dim), jnp.float32)
        return jax.vmap(lambda *row: gated_delta_chunked(*row, start)[0])(q, k, v, g, beta)


def positions_from_mask(attention_mask: jax.Array) -> jax.Array:
    """transformers' left-padding positions: cumsum(mask) - 1, padding positions set to 1."""
    pos = jnp.cumsum(attention_mask, axis=-1) - 1
    return jnp.where(attention_mask == 0, 1, pos).astype(jnp.int32)


@partial(jax.jit, static_argnames=("cfg",))
def forward_dense(weights: Weights, cfg: ModelConfig, tokens: jax.Array, attention_mask: jax.Array,
                  rope_seq_len: jax.Array | None = None, lora: LoraInputs | None = None) -> jax.Array:
    """tokens, attention_mask: [B, S] (left padded). Returns float32 logits [B, S, vocab_size].

    rope_seq_len: the length dynamic RoPE scales for (transformers uses the longest sequence of
    the batch); defaults to max(position) + 1. lora: adapter slots and each token's slot one-hot
    [B, S, N] (lora/apply.py).
    """
    positions = positions_from_mask(attention_mask)
    key_valid = attention_mask.astype(bool)
    if rope_seq_len is None:
        rope_seq_len = jnp.max(positions) + 1
    seq_lens = jnp.broadcast_to(rope_seq_len, positions.shape)
    def attend(i, q, k, v, cache, sinks=None):
        return dense_attention(q, k, v, key_valid, cfg.layer_windows[i], cfg.scale, cfg.attn_soft_cap, sinks), cache

    mixer = DenseMixer(cfg, key_valid) if cfg.linear is not None else None
    logits, _ = forward(weights, cfg, tokens, positions, attend, [None] * cfg.num_layers,
                        seq_lens_per_token=seq_lens, lora=lora, mixer=mixer)
    return logits[..., : cfg.vocab_size]


def left_pad(prompts: Sequence[Sequence[int]], length: int, pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    tokens = np.full((len(prompts), length), pad_id, np.int32)
    mask = np.zeros((len(prompts), length), np.int32)
    for row, prompt in enumerate(prompts):
        tokens[row, length - len(prompt):] = prompt
        mask[row, length - len(prompt):] = 1
    return tokens, mask


def greedy_generate(weights: Weights, cfg: ModelConfig, prompts: Sequence[Sequence[int]],
                    max_new_tokens: int) -> list[list[int]]:
    """Greedy continuation of each prompt (no EOS stop), batched with left padding."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("greedy_generate needs non-empty prompts")
    prompt_len = max(len(p) for p in prompts)
    tokens, mask = left_pad(prompts, prompt_len)
    # Generated tokens are appended on the right; causality hides the not-yet-written columns.
    tokens = np.concatenate([tokens, np.zeros((len(prompts), max_new_tokens), np.int32)], axis=1)
    mask = np.concatenate([mask, np.ones((len(prompts), max_new_tokens), np.int32)], axis=1)
    out = []
    for step in range(max_new_tokens):
        col = prompt_len + step - 1
        logits = forward_dense(weights, cfg, jnp.asarray(tokens), jnp.asarray(mask), jnp.int32(col + 1))
        next_ids = np.asarray(jnp.argmax(logits[:, col], axis=-1))
        tokens[:, col + 1] = next_ids
        out.append(next_ids)
    return np.stack(out, axis=1).tolist()
