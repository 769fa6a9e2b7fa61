"""DeepSeek-R1: the output is reasoning from its start until `</think>`."""

from __future__ import annotations

from .base import ReasoningParser


class DeepSeekR1ReasoningParser(ReasoningParser):
    """R1's chat template ends the prompt with "<think>\\n", so the model usually writes no start tag
    (one it does write is dropped). Without a `</think>` everything is reasoning."""

    name = "deepseek_r1"
    reasoning_by_default = True
