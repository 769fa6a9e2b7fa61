"""OpenAI response and stream-chunk shapes (plain dicts, serialized by the caller).

Completions: `text_completion` objects (streamed as chunks of the same shape). Chat:
`chat.completion` and `chat.completion.chunk`. Logprobs follow each API's own layout: completions
use parallel lists (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`), chat uses a
`content` list of `{token, logprob, bytes, top_logprobs}`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable

# OpenAI reports an impossible token's logprob as -9999.0 rather than -inf (JSON has no infinity).
MIN_LOGPROB = -9999.0


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, logprob) alternatives, best first


def _lp(x: float) -> float:
    return x if math.isfinite(x) else MIN_LOGPROB


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


class TokenStrings:
    """Token id -> (display string, exact UTF-8 bytes), cached per server.

    Byte-level BPE tokens map back to their exact bytes through the GPT-2 byte alphabet, so a token
    holding half of a multi-byte character still reports its true bytes; other tokenizers fall back
    to the UTF-8 of the decoded text.
    """

    def __init__(self, decode: Callable[[list[int]], str], to_tokens: Callable[[list[int]], list[str]]) -> None:
        self._decode = decode
        self._to_tokens = to_tokens
        self._alphabet = _byte_level_alphabet()
        self.get = functools.lru_cache(maxsize=65536)(self._get)

    def _get(self, token_id: int) -> tuple[str, bytes]:
        text = self._decode([token_id])
        piece = self._to_tokens([token_id])[0]
        if piece and all(c in self._alphabet for c in piece):
            raw = bytes(self._alphabet[c] for c in piece)
            if raw.decode("utf-8", errors="replace") == text or "\ufffd" in text:
                return text, raw
        return text, text.encode("utf-8")


def _byte_level_alphabet() -> dict[str, int]:
    """The GPT-2 byte-level alphabet, char -> byte: printable bytes stand for themselves, the other
    68 bytes (controls, space, 0x7f-0xa0, 0xad) are shifted to U+0100 and up, in byte order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {chr(b): b for b in printable}
    shifted = 0
    for b in range(256):
        if b not in printable:
            table[chr(0x100 + shifted)] = b
            shifted += 1
    return table


# ---------------------------------------------------------------- logprobs


class CompletionLogprobs:
    """Builds the completions `logprobs` object for one choice; keeps the running text offset so
    streamed chunks carry offsets into the whole choice text."""

    def __init__(self, strings: TokenStrings) -> None:
        self._strings = strings
        self.offset = 0

    def build(self, entries: list[TokenLogprob]) -> dict:
        tokens, lps, tops, offsets = [], [], [], []
        for e in entries:
            text = self._strings.get(e.token_id)[0]
            tokens.append(text)
            lps.append(_lp(e.logprob))
            top = {self._strings.get(t)[0]: _lp(lp) for t, lp in e.top}
            top.setdefault(text, _lp(e.logprob))  # OpenAI always includes the sampled token
            tops.append(top)
            offsets.append(self.offset)
            self.offset += len(text)
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(entries: list[TokenLogprob], strings: TokenStrings) -> dict:
    def item(token_id: int, logprob: float) -> dict:
        text, raw = strings.get(token_id)
        return {"token": text, "logprob": _lp(logprob), "bytes": list(raw)}

    return {"content": [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
                        for e in entries], "refusal": None}


# ---------------------------------------------------------------- stream chunks


def completion_chunk(rid: str, created: int, model: str, index: int, text: str, logprobs: dict | None,
                     finish_reason: str | None, with_usage: bool) -> dict:
    chunk: dict[str, Any] = {"id": rid, "object": "text_completion", "created": created, "model": model,
                             "choices": [{"index": index, "text": text, "logprobs": logprobs,
                                          "finish_reason": finish_reason}],
                             "system_fingerprint": None}
    if with_usage:
        chunk["usage"] = None
    return chunk


def chat_chunk(rid: str, created: int, model: str, index: int, delta: dict, logprobs: dict | None,
               finish_reason: str | None, with_usage: bool) -> dict:
    chunk: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                             "system_fingerprint": None,
                             "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                                          "finish_reason": finish_reason}]}
    if with_usage:
        chunk["usage"] = None
    return chunk


def usage_chunk(kind: str, rid: str, created: int, model: str, usage_: dict) -> dict:
    obj = "text_completion" if kind == "completion" else "chat.completion.chunk"
    return {"id": rid, "object": obj, "created": created, "model": model, "system_fingerprint": None,
            "choices": [], "usage": usage_}


# ---------------------------------------------------------------- whole responses


def completion_response(rid: str, created: int, model: str, choices: list[dict], usage_: dict) -> dict:
    """choices: [{"index", "text", "logprobs", "finish_reason"}]"""
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices,
            "usage": usage_, "system_fingerprint": None}


def chat_response(rid: str, created: int, model: str, choices: list[dict], usage_: dict) -> dict:
    """choices: [{"index", "message", "logprobs", "finish_reason"}]"""
    return {"id": rid, "object": "chat.completion", "created": created, "model": model, "choices": choices,
            "usage": usage_, "system_fingerprint": None}
