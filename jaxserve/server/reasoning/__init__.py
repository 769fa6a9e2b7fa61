"""Reasoning parsers (`--reasoning-parser NAME`): split a chat completion into reasoning and answer.

A new family is one small module defining a `ReasoningParser` subclass plus one line below.
"""

from __future__ import annotations

from .base import ReasoningDelta, ReasoningParser
from .deepseek_r1 import DeepSeekR1ReasoningParser
from .qwen3 import Qwen3ReasoningParser

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "qwen3": Qwen3ReasoningParser,
}


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    """The parser class registered as `name`; ValueError naming the known ones otherwise."""
    try:
        return REASONING_PARSERS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown reasoning parser {name!r}; known parsers: "
                         f"{', '.join(sorted(REASONING_PARSERS))}") from None


__all__ = [
    "REASONING_PARSERS",
    "DeepSeekR1ReasoningParser",
    "Qwen3ReasoningParser",
    "ReasoningDelta",
    "ReasoningParser",
    "get_reasoning_parser",
]
