"""Per-sequence grammar state and the step's token bitmask.

A `CompiledGrammar` is a matcher in its initial state, shared read-only; each sampled sequence gets
its own `Guide` (a deep copy), which the scheduler advances with every token it appends.
`fill_bitmask` computes the masks of one step's rows in parallel (llguidance's executor releases
the GIL) into the `[rows, ceil(vocab / 32)]` int32 layout the sampler reads: bit j of word w
allows token 32 w + j; rows without a live guide stay all ones.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Sequence

import numpy as np

logger = logging.getLogger("jaxserve.structured")


class CompiledGrammar:
    def __init__(self, matcher: Any, text: str, tokenizer: Any) -> None:
        self._matcher = matcher    # initial state; never advanced
        self.text = text
        self._tokenizer = tokenizer  # the llguidance tokenizer it was compiled for

    def new_guide(self) -> "Guide":
        return Guide(self._matcher.deep_copy(), self._tokenizer)


class Guide:
    """One sequence's position in its grammar."""

    __slots__ = ("matcher", "tokenizer", "failed")

    def __init__(self, matcher: Any, tokenizer: Any) -> None:
        self.matcher = matcher
        self.tokenizer = tokenizer
        self.failed = False

    def accept(self, token_id: int) -> bool:
        """Advances past a sampled token; False (and `finished`) if the grammar rejects it, which
        the mask should have made impossible."""
        if self.failed:
            return False
        if self.tokenizer.is_special_token(token_id) and not self.matcher.validate_tokens([token_id]):
            accepted = self._accept_as_text(token_id)
        else:
            accepted = self.matcher.consume_token(token_id)
        if not accepted:
            self.failed = True
            logger.warning("grammar rejected token %d: %s", token_id, self.matcher.get_error())
            return False
        return True

    def _accept_as_text(self, token_id: int) -> bool:
        """llguidance 1.9 masks: where a grammar forces literal text such as "<tool_call>" that the
        tokenizer spells with one added token, the mask allows that token (the text's canonical
        tokenization) but consuming it fails, because the matcher treats added tokens as special.
        The token's text is what the grammar wants: advance by the same text in plain tokens."""
        plain = self.tokenizer.greedy_tokenize(self.tokenizer.decode_str([token_id]))
        return bool(plain) and self.matcher.validate_tokens(plain) == len(plain) and self.matcher.consume_tokens(plain)

    def valid_prefix(self, token_ids: Sequence[int]) -> int:
        """How many leading tokens of `token_ids` the grammar would accept in turn (state unchanged):
        speculative drafts are cut there."""
        return 0 if self.failed else self.matcher.validate_tokens(list(token_ids))

    def advanced(self, token_ids: Sequence[int]) -> "Guide":
        """A copy of this guide past `token_ids` (the state a speculative draft row samples in)."""
        guide = Guide(self.matcher.deep_copy(), self.tokenizer)
        guide.failed = self.failed
        for t in token_ids:
            if not guide.accept(t):
                break
        return guide

    @property
    def finished(self) -> bool:
        """The grammar is complete and allows nothing more (or it failed): the sequence stops."""
        return self.failed or self.matcher.is_stopped()


_executor = None
_executor_lock = threading.Lock()


def _parallel_executor() -> Any:
    global _executor
    with _executor_lock:
        if _executor is None:
            import llguidance

            _executor = llguidance.LLExecutor()
        return _executor


def fill_bitmask(guides: Sequence[Guide | None], num_rows: int, num_words: int) -> np.ndarray:
    """[num_rows, num_words] int32 masks: row i from guides[i] when it is live, else all ones."""
    import llguidance.numpy as llg_np

    mask = np.full((num_rows, num_words), -1, np.int32)
    live = [(g.matcher, i) for i, g in enumerate(guides) if g is not None and not g.finished]
    if live:
        llg_np.fill_next_token_bitmask_par(_parallel_executor(), live, mask)
    return mask
