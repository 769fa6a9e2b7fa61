"""Where a tool-call format's tags meet the served vocabulary.

A format marks its calls with tags (Hermes: `<tool_call>` ... `</tool_call>`), and its parser reads
them in the decoded text. Vocabularies hold a tag in one of three ways:

- one added token that is not special (Qwen2.5, Qwen3): decoding keeps it, nothing to do;
- one added token marked special (tokenizers saved with the tags among their special tokens, as some
  fine-tunes ship them): decoding with `skip_special_tokens` (the default) drops it, so a parser
  would see the call's JSON without its tags, find nothing, and the call would leak into `content`;
- no token at all (Qwen1.5, Llama): the model spells the tag out in ordinary tokens.

`ToolTags` records which case holds for each tag, once per server, so that a forced-call grammar
writes a tag as the token where there is one (what a model trained on the format writes; llguidance
keeps added tokens apart from text, so the quoted text would never match it) and as text otherwise,
and so that the text a tool parser reads keeps the tag tokens, special or not.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol


class Decoder(Protocol):
    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class _Vocabulary(Decoder, Protocol):  # jaxserve.text.tokenizer.Tokenizer
    @property
    def all_special_ids(self) -> list[int]: ...
    def added_vocab(self) -> dict[str, int]: ...


@dataclasses.dataclass(frozen=True)
class ToolTags:
    tokens: dict[str, int] = dataclasses.field(default_factory=dict)  # tag -> id, where one added token
    special_ids: frozenset[int] = frozenset()  # the ids among those that the tokenizer marks special

    @classmethod
    def of(cls, tags: Sequence[str], tokenizer: _Vocabulary) -> "ToolTags":
        """How `tokenizer` holds each of a format's `tags`."""
        added = tokenizer.added_vocab()
        tokens = {t: added[t] for t in tags if t in added}
        return cls(tokens, frozenset(tokens.values()) & frozenset(tokenizer.all_special_ids))

    def decoder(self, tokenizer: _Vocabulary) -> Decoder:
        """What a request whose output a tool parser reads decodes with: the tokenizer itself,
        unless some tag is a special token, which must then survive skip_special_tokens."""
        return _KeepingTags(tokenizer, self.special_ids) if self.special_ids else tokenizer


class _KeepingTags:
    """Decodes as `tokenizer` does, except that skip_special_tokens keeps the `keep` ids."""

    def __init__(self, tokenizer: _Vocabulary, keep: frozenset[int]) -> None:
        self._tokenizer = tokenizer
        self._skip = frozenset(tokenizer.all_special_ids) - keep

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if skip_special_tokens:  # drop the other special tokens here, decode the rest as they are
            token_ids = [t for t in token_ids if t not in self._skip]
        return self._tokenizer.decode(token_ids, skip_special_tokens=False)
