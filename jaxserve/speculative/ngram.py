"""Prompt-lookup (n-gram) proposals from a sequence's own tokens (host, numpy, no jax).

The last n tokens (n from prompt_lookup_max down to prompt_lookup_min, longest first) are looked
up in the earlier tokens of the same sequence (prompt + output); the k tokens that followed the
most recent earlier occurrence with k tokens after it are the proposal, or when every occurrence is
too close to the end, those after the earliest (the most there are: in a repeating run the latest
occurrence is the suffix shifted by one and would propose a single token). No match: no proposal.
The engine keeps each sequence's tokens in a `TokenHistory`, so a step appends the new tokens
instead of converting the whole context to an array again.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


def propose(tokens: Sequence[int] | np.ndarray, k: int, min_n: int, max_n: int) -> np.ndarray:
    """Up to k proposed next tokens ([<= k] int32; empty when no n-gram of the suffix recurs)."""
    seq = np.asarray(tokens, dtype=np.int64)
    length = len(seq)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = seq[length - n:]
        # windows[i] = seq[i:i+n] for every start i < length - n: earlier than the suffix itself
        windows = np.lib.stride_tricks.sliding_window_view(seq[:length - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if len(hits):
            starts = hits + n                        # the token after each earlier occurrence
            full = starts[starts + k <= length]
            start = full[-1] if len(full) else starts[0]
            return seq[start:start + k].astype(np.int32)
    return np.zeros(0, np.int32)



class TokenHistory:
    """A sequence's tokens as a growing int64 array, extended by the tokens appended since the last
    call: `propose(history.view(), ...)` then copies nothing per step (the search itself is one
    vectorised pass per n over the context)."""

    def __init__(self) -> None:
        self._buf = np.zeros(64, np.int64)
        self.length = 0

    def extend(self, tokens: Sequence[int]) -> None:
        n = self.length + len(tokens)
        if n > len(self._buf):
            grown = np.zeros(max(n, 2 * len(self._buf)), np.int64)
            grown[:self.length] = self._buf[:self.length]
            self._buf = grown
        self._buf[self.length:n] = tokens
        self.length = n

    def view(self) -> np.ndarray:
        return self._buf[:self.length]
