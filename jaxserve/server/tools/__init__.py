"""OpenAI tool calling: request validation and the per-model-family tool-call formats.

A format is one module with a `ToolParser` subclass (see base.py) plus one line in TOOL_PARSERS.
"""

from __future__ import annotations

from jaxserve.server.tools.base import ToolCall, ToolCallDelta, ToolParser, new_tool_call_id
from jaxserve.server.tools.hermes import HermesToolParser
from jaxserve.server.tools.validation import validate_parallel_tool_calls, validate_tool_choice, validate_tools

# --tool-call-parser NAME -> the parser class.
DEFAULT_TOOL_PARSER = "hermes"  # for forced calls when no --tool-call-parser is given
TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
}


def get_tool_parser(name: str) -> type[ToolParser]:
    """The parser class registered under `name`; ValueError naming the known ones otherwise."""
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        known = ", ".join(sorted(TOOL_PARSERS))
        raise ValueError(f"unknown tool-call parser {name!r}; known parsers: {known}") from None


__all__ = [
    "DEFAULT_TOOL_PARSER",
    "TOOL_PARSERS",
    "HermesToolParser",
    "ToolCall",
    "ToolCallDelta",
    "ToolParser",
    "get_tool_parser",
    "new_tool_call_id",
    "validate_parallel_tool_calls",
    "validate_tool_choice",
    "validate_tools",
]
