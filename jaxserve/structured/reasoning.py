"""The Lark prefix that lets a reasoning model think before its constrained answer.

A response format or a forced tool call applies only after the reasoning ends, so the grammar is
`<reasoning part> @body`. What the reasoning part is follows from the same facts the reasoning
parser (server/reasoning/) reads from the prompt:
  - the template closed an empty block ("</think>\\n\\n", Qwen3 with enable_thinking=false): none;
  - the prompt leaves a block open ("<think>\\n", DeepSeek-R1 templates), or the family reasons by
    default: free text up to the end tag;
  - otherwise (Qwen3 thinking mode): an optional whole block.
The tags are the tokenizer's added tokens (`<think>` is one token in Qwen3 and DeepSeek-R1
vocabularies): in Lark they are written as tokens, so free reasoning text can never close the block
by spelling the tag out of smaller pieces.
"""

from __future__ import annotations

from typing import Protocol


class ReasoningFamily(Protocol):
    start_tag: str
    end_tag: str
    reasoning_by_default: bool

    @classmethod
    def prompt_closes_reasoning(cls, prompt_text: str) -> bool: ...

    @classmethod
    def starts_in_reasoning(cls, prompt_text: str) -> bool: ...


def reasoning_prefix(family: ReasoningFamily | None, prompt_text: str) -> str:
    """Lark for what may precede the constrained body ("" for nothing)."""
    if family is None or family.prompt_closes_reasoning(prompt_text):
        return ""
    # The end tag, then the newlines the parser strips after it (models write "</think>\n\n").
    free_until_end = f'/(.|\\n)*/ {family.end_tag} "\\n"{{0,2}}'
    if family.starts_in_reasoning(prompt_text):
        return free_until_end
    if family.reasoning_by_default:
        return f"{family.start_tag}? {free_until_end}"
    return f"({family.start_tag} {free_until_end})?"
