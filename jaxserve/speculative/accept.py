"""Verification of one-hot proposals by sampling (host, no jax): the rule every proposer without a
distribution of its own uses (n-gram lookup; a draft model proposing its argmax).

Each of a sequence's 1 + d rows (its last known token, then the d drafts) is sampled exactly as
without speculation: the same processed distribution (penalties, min_tokens, grammar mask and
truncation given the drafts before it), the same seed key (seed, output index). Draft j is accepted
while row j sampled it; the sequence emits the sampled tokens of rows 0..a, where a is the number
of accepted drafts (the last one is the correction at a rejection, or the bonus token when every
draft was accepted).

Why this is lossless: row j's sample x ~ p_j, and draft d_j is accepted iff x == d_j, which
happens with probability p_j(d_j) = min(1, p_j(d_j) / q_j(d_j)) for q_j one-hot at d_j; given a
rejection, x is distributed as p_j without d_j, renormalised, which is normalise(max(p_j - q_j, 0)).
That is standard speculative sampling (Leviathan et al. 2023) for one-hot q. More: since row j draws
with the key sampling alone would use for that output index, a seeded request emits the very
tokens it emits without speculation, and greedy rows accept exactly the argmax prefix.
"""

from __future__ import annotations

from typing import Sequence


def num_accepted(drafts: Sequence[int], sampled: Sequence[int]) -> int:
    """How many leading drafts the sampled rows confirm: sampled[j] == drafts[j] for j < result.
    `sampled` holds one token per row (len(drafts) + 1 of them)."""
    if len(sampled) != len(drafts) + 1:
        raise ValueError(f"{len(drafts)} drafts need {len(drafts) + 1} sampled rows, got {len(sampled)}")
    a = 0
    while a < len(drafts) and sampled[a] == drafts[a]:
        a += 1
    return a
