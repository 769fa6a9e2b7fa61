"""Prompt-lookup (n-gram) proposals from a sequence's own tokens (host, no jax).

The last n tokens (n from prompt_lookup_max down to prompt_lookup_min, longest first) are looked
up in the earlier tokens of the same sequence (prompt + output); the k tokens that followed the
most recent earlier occurrence with k tokens after it are the proposal, or when every occurrence is
too close to the end, those after the earliest (the most there are: in a repeating run the latest
occurrence is the suffix shifted by one and would propose a single token). No match: no proposal.

The engine keeps each sequence's tokens in a `TokenHistory`: 4 bytes per token in a bytearray that a
step extends by the tokens appended since the last proposal. A lookup is then bytes.rfind / find
of the suffix's bytes (C's substring search: 18x the numpy sliding-window comparison it replaced at
8k tokens, 17x at 128 where numpy's per-call overhead dominated), a hit that does not start on a
token boundary being skipped; the earliest occurrence is only looked for among the last k tokens,
where the latest search left it.
"""

from __future__ import annotations

from array import array
from typing import Sequence

import numpy as np

_TOKEN = array("i").itemsize  # bytes per token
assert _TOKEN == 4, "int32 tokens"


class TokenHistory:
    """A sequence's tokens as int32 bytes, extended by the tokens appended since the last call."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self.length = 0

    def extend(self, tokens: Sequence[int]) -> None:
        if tokens:
            self._buf += array("i", tokens).tobytes()
            self.length += len(tokens)

    def propose(self, k: int, min_n: int, max_n: int) -> np.ndarray:
        """Up to k proposed next tokens ([<= k] int32; empty when no n-gram of the suffix recurs)."""
        buf, length = self._buf, self.length
        for n in range(min(max_n, length - 1), min_n - 1, -1):
            suffix = buf[(length - n) * _TOKEN:]
            # the latest occurrence ending by token length - k (k tokens follow it; earlier than the suffix)
            i = self._find(suffix, 0, length - k, latest=True) if length - k >= n else -1
            if i < 0:  # else the earliest one ending before the last token: after length - k, if any
                i = self._find(suffix, max(0, length - k - n + 1), length - 1, latest=False)
            if i >= 0:
                start = i + n
                return np.frombuffer(buf[start * _TOKEN:(start + k) * _TOKEN], np.int32)
        return np.zeros(0, np.int32)

    def _find(self, needle: bytearray, start: int, stop: int, latest: bool) -> int:
        """Token index of the latest (or earliest) occurrence of `needle` starting at or after token
        `start` and ending at or before token `stop`; -1 when none. A byte match off a token
        boundary is skipped."""
        lo, hi = start * _TOKEN, stop * _TOKEN
        while True:
            at = self._buf.rfind(needle, lo, hi) if latest else self._buf.find(needle, lo, hi)
            if at < 0 or at % _TOKEN == 0:
                return at // _TOKEN if at >= 0 else -1
            if latest:
                hi = at + len(needle) - 1  # only matches starting before this one
            else:
                lo = at + 1

