"""What every tool-call format shares: the call and delta records, the parser interface, call ids.

A `ToolParser` turns model text into OpenAI tool calls, in one piece (`parse`) or while streaming
(`feed` ... `finish`), and builds the grammar that forces a model to call tools in its format
(`grammar`). One parser instance serves one choice of one request: streaming state lives on it.

A forced call's grammar and its parser must agree on the text: the grammar writes each of the
format's `tags` as the token the vocabulary holds for it, or as text where it holds none (tags.py),
and the server decodes such requests so that tag tokens survive skip_special_tokens.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
import string
from collections.abc import Mapping
from typing import Any

_ID_ALPHABET = string.ascii_letters + string.digits


def new_tool_call_id() -> str:
    """A fresh OpenAI-style call id: "call_" and 24 random letters/digits."""
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


@dataclasses.dataclass
class ToolCall:
    """A complete call, for non-streamed responses."""

    id: str
    name: str
    arguments: str  # the arguments JSON object as text, exactly as the model wrote it (stripped)


@dataclasses.dataclass
class ToolCallDelta:
    """One streamed fragment of a call, in the shape of OpenAI's `delta.tool_calls[i]`."""

    index: int                # which call of this choice: 0, 1, ...
    id: str | None = None     # set on the first delta of a call only
    name: str | None = None   # set on the first delta of a call only
    arguments: str = ""       # the next fragment of the arguments text


class ToolParser:
    """Base of the per-format parsers; subclasses implement `feed`, `finish` and `grammar`, and
    name their format's `tags`.

    Streaming contract: for each call, the first delta carries index, id and name; the ones after
    carry argument fragments. The fragments of a call concatenate to the `arguments` that `parse`
    returns for the same text, however the text was cut into chunks (subclasses document where a
    malformed call makes streaming and `parse` differ).
    """

    name: str = ""
    tags: tuple[str, ...] = ()  # the strings that delimit calls in this format (tags.py)

    def __init__(self, tools: list[dict]) -> None:
        self.tools = tools  # validated by validate_tools (OpenAI shape)

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """Consume the next piece of generated text; return (content delta, tool-call deltas)."""
        raise NotImplementedError

    def finish(self, truncated: bool = False) -> tuple[str, list[ToolCallDelta]]:
        """Flush whatever is held back once generation has ended. truncated: it ended at max_tokens,
        so a call it was writing is cut: one already announced stays a call (its arguments as far
        as they were written), one not yet announced is dropped (its markup is never content)."""
        raise NotImplementedError

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The whole generated text -> (content or None when empty, complete calls).

        Default: run the streaming path over the text and assemble its deltas. Formats whose
        non-streamed answer is stricter than streaming can be (e.g. a malformed block becomes
        content) override this.
        """
        return self.parse_as_streamed(text)

    def parse_as_streamed(self, text: str, truncated: bool = False) -> tuple[str | None, list[ToolCall]]:
        """What a stream of `text` reassembles to: feed + finish(truncated) on a fresh parser.

        For a forced tool choice the server answers with this rather than `parse`: the output is
        known to be calls, so a call cut off by max_tokens stays the call that streaming sent
        (its arguments as far as they were written), never raw text in `content`."""
        fresh = type(self)(self.tools)
        content, deltas = fresh.feed(text)
        tail, more = fresh.finish(truncated)
        return (content + tail) or None, assemble_calls(deltas + more)

    @classmethod
    def grammar(cls, tools: list[dict], tool_choice: str | dict, parallel_tool_calls: bool,
                tag_tokens: Mapping[str, int]) -> str:
        """An llguidance Lark grammar whose every sentence is tool calls in this format:
        tool_choice "required" -> calls of any of `tools`; {"type": "function", "function":
        {"name": N}} -> calls of N only. One call, or one or more when parallel_tool_calls.
        `tag_tokens`: the tags the vocabulary holds as one added token, with their ids
        (ToolTags.tokens); write tags with `lark_tag` so the model writes what the parser reads."""
        raise NotImplementedError


def lark_tag(tag: str, tag_tokens: Mapping[str, int]) -> str:
    """A tag in a Lark grammar: the added token, by id, where the vocabulary has one (llguidance
    holds added tokens apart from text: the quoted text would never match the token a model
    trained on the format writes), else the quoted text, spelled in ordinary tokens."""
    return f"<[{tag_tokens[tag]}]>" if tag in tag_tokens else json.dumps(tag)


def assemble_calls(deltas: list[ToolCallDelta]) -> list[ToolCall]:
    """Streamed deltas -> complete calls, in index order."""
    calls: dict[int, ToolCall] = {}
    for d in deltas:
        if d.index not in calls:
            calls[d.index] = ToolCall(id=d.id or new_tool_call_id(), name=d.name or "", arguments="")
        calls[d.index].arguments += d.arguments
    return [calls[i] for i in sorted(calls)]


def forced_tool_names(tools: list[dict], tool_choice: str | dict) -> list[str]:
    """The function names a grammar must allow for this tool_choice ("required" or a named one)."""
    names = [t["function"]["name"] for t in tools]
    if tool_choice == "required":
        if not names:
            raise ValueError("tool_choice 'required' needs at least one tool")
        return names
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        if name not in names:
            raise ValueError(f"tool_choice names function {name!r}, which is not in tools")
        return [name]
    raise ValueError(f"tool_choice {tool_choice!r} does not force tool calls; no grammar is needed")


# Options for llguidance's JSON compiler (the "x-guidance" key of a schema): forced JSON comes out
# compact, with the separators json.dumps and the chat template's tojson use, as models are trained.
JSON_COMPILE_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def arguments_schema(function: dict, pointer: str) -> dict:
    """The JSON schema of one function's arguments, to be placed at JSON pointer `pointer` of a
    larger schema (e.g. "#/anyOf/0/properties/arguments").

    Local references ("#/$defs/x", "#") are rebased onto `pointer` so they still resolve there. A
    function without parameters takes only the empty object.
    """
    params = function.get("parameters")
    if params is None:
        return {"type": "object", "properties": {}, "additionalProperties": False}
    schema = _rebase_refs(params, pointer)
    schema.setdefault("type", "object")
    return schema


def _rebase_refs(node: Any, pointer: str) -> Any:
    if isinstance(node, dict):
        return {k: (pointer + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#")
                    else _rebase_refs(v, pointer))
                for k, v in node.items()}
    if isinstance(node, list):
        return [_rebase_refs(v, pointer) for v in node]
    return node
