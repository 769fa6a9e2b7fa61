"""Qwen3: reasoning only when the output opens `<think>` (or the prompt left one open)."""

from __future__ import annotations

from .base import ReasoningParser


class Qwen3ReasoningParser(ReasoningParser):
    """Qwen3 thinks only when asked: with enable_thinking=false the template writes an empty closed
    block, and an output without a leading `<think>` is all answer. Newer Qwen3 templates open the
    block themselves ("<think>\\n" at the prompt's end); the prompt check covers that case."""

    name = "qwen3"
