"""Incremental detokenization of one output stream, with stop strings.

Two stages per `push`:

1. Token ids -> final text. Decoding one token at a time is wrong twice over: a character whose
   UTF-8 bytes span tokens decodes as U+FFFD, and SentencePiece drops the leading space of the
   first token it decodes. So we keep a small window of ids, `window = [context | pending]`, where
   `context` is the tokens released last time (already emitted, decoded only for their effect on
   spacing) and `pending` is what came after. Each push decodes the window and diffs it against
   the text already released from it. A trailing U+FFFD run may be an incomplete character, so it
   is held until later bytes complete it (or `flush` gives it up). When the window's text is
   clean, the window slides: the pending tokens become the next context. Per-push cost depends on
   the window, never on the total length.

2. Final text -> deltas. Text that could be the beginning of a stop string is held back until it
   is known not to be one; at a match the stream stops and the stop string is cut out (kept with
   `include_stop_str_in_output`).

For byte-level BPE (GPT-2, Llama 3, Qwen) the deltas concatenate to
`tokenizer.decode(output_ids)` exactly (up to the stop cut). For SentencePiece the first output
token keeps its leading space when the prompt provides context, as a continuation of the prompt.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

REPLACEMENT = "\ufffd"
# Prompt tokens decoded ahead of the first output token (for SentencePiece leading spaces).
INITIAL_CONTEXT_TOKENS = 4
# A trailing U+FFFD run is given up on (emitted as is) once this many tokens are pending. A UTF-8
# character spans at most 4 tokens, so only undecodable garbage gets here; the cap keeps the
# window bounded.
MAX_PENDING_TOKENS = 32


class _Decoder(Protocol):
    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...


@dataclass(frozen=True)
class DetokResult:
    delta: str              # new text for the client (may be empty)
    stopped: bool           # a stop string matched: the stream is over, later tokens are ignored
    stop_str: str | None    # the stop string that matched, if any


class IncrementalDetokenizer:
    """Turns one sequence's output token ids into streamed text deltas, watching for stop strings."""

    def __init__(
        self,
        tokenizer: _Decoder,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        stop: Iterable[str] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        if isinstance(stop, str):
            raise ValueError("stop must be a list of strings, not a single string")
        stops = list(stop)
        for s in stops:
            if not isinstance(s, str) or s == "":
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._stops = stops
        self._include_stop = include_stop_str_in_output
        self._max_stop_len = max((len(s) for s in stops), default=0)

        # Stage 1 state: window = ids[prefix:], window[:read] already released, `released` chars of
        # decode(window) already handed to stage 2.
        context = [int(t) for t in list(prompt_token_ids)[-INITIAL_CONTEXT_TOKENS:]]
        context_text = self._decode(context)
        if context_text.endswith(REPLACEMENT):
            # The prompt ends inside a character: its bytes would change how the output decodes.
            context, context_text = [], ""
        self._window: list[int] = context
        self._read = len(context)
        self._released = len(context_text)

        # Stage 2 state: text that may be the start of a stop string.
        self._held = ""
        self._stopped = False
        self._stop_str: str | None = None
        self._flushed = False

    @property
    def stopped(self) -> bool:
        return self._stopped

    @property
    def stop_str(self) -> str | None:
        return self._stop_str

    def push(self, token_ids: Sequence[int]) -> DetokResult:
        """Add newly sampled ids; return the text that is now safe to send."""
        if self._flushed:
            raise ValueError("push() after flush(): the stream is finished")
        if self._stopped:
            return DetokResult("", True, self._stop_str)
        for t in token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ValueError(f"token ids must be non-negative ints, got {t!r}")
        if not token_ids:
            return DetokResult("", False, None)
        self._window.extend(token_ids)
        return self._emit(self._release(final=False))

    def flush(self) -> str:
        """At finish: release everything still held (held-back stop prefixes, incomplete bytes)."""
        if self._flushed or self._stopped:
            self._flushed = True
            return ""
        self._flushed = True
        text = self._release(final=True)
        result = self._emit(text, final=True)
        return result.delta

    # ------------------------------------------------------------ stage 1: ids -> final text

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip) if ids else ""

    def _release(self, final: bool) -> str:
        text = self._decode(self._window)
        pending = len(self._window) - self._read
        if text.endswith(REPLACEMENT) and not final and pending < MAX_PENDING_TOKENS:
            # Release what precedes the trailing U+FFFD run; it cannot change any more.
            safe = len(text.rstrip(REPLACEMENT))
            new = text[self._released:safe]
            self._released = max(self._released, safe)
            return new
        new = text[self._released:]
        if new or pending >= MAX_PENDING_TOKENS:
            # Slide: the tokens just released become the context. Without growth (tokens that
            # decode to nothing, e.g. skipped specials) we keep the old context, which SentencePiece
            # needs for the space of the next word.
            self._window = self._window[self._read:]
            self._read = len(self._window)
            self._released = len(self._decode(self._window))
        return new

    # ------------------------------------------------------------ stage 2: stop strings

    def _emit(self, new_text: str, final: bool = False) -> DetokResult:
        buf = self._held + new_text
        match = self._find_stop(buf)
        if match is not None:
            idx, s = match
            self._stopped, self._stop_str, self._held = True, s, ""
            return DetokResult(buf[: idx + len(s)] if self._include_stop else buf[:idx], True, s)
        keep = 0 if final else self._stop_prefix_len(buf)
        self._held = buf[len(buf) - keep:] if keep else ""
        return DetokResult(buf[: len(buf) - keep], False, None)

    def _find_stop(self, buf: str) -> tuple[int, str] | None:
        """The earliest stop string in buf (ties: the one listed first)."""
        best: tuple[int, str] | None = None
        for s in self._stops:
            idx = buf.find(s)
            if idx >= 0 and (best is None or idx < best[0]):
                best = (idx, s)
        return best

    def _stop_prefix_len(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of some stop string."""
        for n in range(min(len(buf), self._max_stop_len - 1), 0, -1):
            tail = buf[-n:]
            if any(s.startswith(tail) for s in self._stops):
                return n
        return 0
