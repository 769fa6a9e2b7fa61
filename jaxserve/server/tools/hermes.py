"""The Hermes tool-call format, used by Qwen2.5, Qwen3 and Hermes 2/3 models.

Each call is a block

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

possibly several (parallel calls), possibly after some text. This parser reads text, never token
ids: in the Qwen2.5/Qwen3 vocabulary `<tool_call>` and `</tool_call>` are added tokens that are not
special, so decoding keeps them; where a tokenizer marks them special, the server decodes the
requests this parser reads so that they survive anyway, and where a vocabulary has no such tokens
the tags are plain text (tags.py).

Rules, the same streamed and in one piece unless noted:
- Text outside blocks is content; whitespace right before or after a call's block is dropped
  (the chat template puts a newline there; it is not part of the answer). Text without calls
  comes back unchanged.
- A block ends at the first `</tool_call>`, even inside a JSON string.
- A block is a call when it holds one JSON object with a string "name" and an object "arguments"
  (missing "arguments" means `{}`), each key once; other keys are ignored. `arguments` is the raw
  text of that object as the model wrote it. Any other block is content, tags included.
- A block cut off by the end of generation (no `</tool_call>`) is a call if its JSON is complete
  and valid, else content.

Streaming commits to a call early so its arguments can be streamed as they are written: once the
name is known and the "arguments" value has begun with `{` (or the object closed without one), the
header delta goes out. The JSON is checked as it comes (call_scanner.py), so a block broken before
that point is never announced, and arguments stop streaming at the character that breaks them. A
committed block that later proves malformed (bad JSON after that point, a repeated key, no end
before generation stops) stays a call whose arguments are what was streamed, each character a valid
continuation; the rest of its block is dropped, whereas `parse` returns such a block as content.
Before that point streaming and `parse` decide identically, for every way the text is cut into
chunks.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from jaxserve.server.tools.base import (JSON_COMPILE_OPTIONS, ToolCall, ToolCallDelta, ToolParser, arguments_schema,
    assemble_calls, forced_tool_names, lark_tag, new_tool_call_id)
from jaxserve.server.tools.call_scanner import CallScanner, WHITESPACE, partial_tag_len

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"
    tags = (OPEN_TAG, CLOSE_TAG)

    def __init__(self, tools: list[dict], *, stream_calls: bool = True) -> None:
        super().__init__(tools)
        # stream_calls=False decides each block only once it has ended: `parse` uses that mode.
        self._stream_calls = stream_calls
        self._in_block = False
        self._held = ""            # text not yet decided: a partial tag, whitespace that may precede a tag
        self._after_block = False  # drop whitespace until the first other character after a block
        self._next_index = 0
        self._content: list[str] = []
        self._deltas: list[ToolCallDelta] = []
        self._start_block()

    # ------------------------------------------------------------ streaming

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        buf = self._held + text
        self._held = ""
        while buf:
            buf = self._feed_block(buf) if self._in_block else self._feed_text(buf)
        return self._take()

    def finish(self, truncated: bool = False) -> tuple[str, list[ToolCallDelta]]:
        if self._in_block:
            # Cut off before its closing tag. What is held back is the start of that tag, cut off
            # too: not part of the JSON.
            held, self._held = self._held, ""
            self._end_block(closed=False, tail=held, drop=truncated)
        else:
            held, self._held = self._held, ""
            if self._after_block:  # whitespace after a block is dropped, a partial tag is not
                held = held.lstrip(WHITESPACE)
            self._content.append(held)
        return self._take()

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        whole = type(self)(self.tools, stream_calls=False)
        content, deltas = whole.feed(text)
        tail, more = whole.finish()
        return (content + tail) or None, assemble_calls(deltas + more)

    def _take(self) -> tuple[str, list[ToolCallDelta]]:
        content, deltas = "".join(self._content), self._deltas
        self._content, self._deltas = [], []
        return content, deltas

    def _feed_text(self, buf: str) -> str:
        """Content mode: emit text up to a `<tool_call>`; return what follows the tag (or "")."""
        at = buf.find(OPEN_TAG)
        if at >= 0:
            before = buf[:at].lstrip(WHITESPACE) if self._after_block else buf[:at]
            body = before.rstrip(WHITESPACE)
            self._emit_content(body)
            self._in_block = True
            self._start_block()
            self._space_before = before[len(body):]  # given back if the block turns out to be content
            return buf[at + len(OPEN_TAG):]
        keep = len(buf) - partial_tag_len(buf, OPEN_TAG)
        ready = buf[:keep]
        # Trailing whitespace waits too: if a tag follows it, it is dropped.
        body = ready.rstrip(WHITESPACE)
        self._emit_content(body)
        self._held = ready[len(body):] + buf[keep:]
        return ""

    def _emit_content(self, text: str) -> None:
        if self._after_block:
            text = text.lstrip(WHITESPACE)
            if not text:
                return
            self._after_block = False
        if text:
            self._content.append(text)

    def _feed_block(self, buf: str) -> str:
        """Block mode: scan up to `</tool_call>`; return what follows the tag (or "")."""
        at = buf.find(CLOSE_TAG)
        if at >= 0:
            self._scan(buf[:at])
            self._end_block(closed=True)
            return buf[at + len(CLOSE_TAG):]
        keep = len(buf) - partial_tag_len(buf, CLOSE_TAG)
        self._scan(buf[:keep])
        self._held = buf[keep:]
        return ""

    # ------------------------------------------------------------ one block

    def _start_block(self) -> None:
        self._raw: list[str] = []          # the block's text after <tool_call>
        self._space_before = ""            # whitespace dropped before <tool_call>
        self._scanner = CallScanner()
        self._committed: int | None = None  # index of the call streamed for this block
        self._sent = 0                      # characters of the arguments streamed so far

    def _scan(self, text: str) -> None:
        if not text:
            return
        self._raw.append(text)
        sc = self._scanner
        sc.feed(text)
        if not self._stream_calls:
            return
        if self._committed is None and sc.ready:
            self._committed = self._next_index
            self._next_index += 1
            self._deltas.append(ToolCallDelta(self._committed, new_tool_call_id(), sc.name, ""))
        if self._committed is not None:
            fragment = sc.arguments_from(self._sent)
            if fragment:
                self._add_arguments(self._committed, fragment)
                self._sent += len(fragment)

    def _add_arguments(self, index: int, fragment: str) -> None:
        last = self._deltas[-1] if self._deltas else None
        if last is not None and last.index == index:
            last.arguments += fragment  # one delta per call per feed
        else:
            self._deltas.append(ToolCallDelta(index, arguments=fragment))

    def _end_block(self, closed: bool, tail: str = "", drop: bool = False) -> None:
        """drop: a block that is not a call is dropped rather than given back as content (cut by
        max_tokens: the model was writing a call)."""
        self._in_block = False
        self._after_block = True
        if self._committed is None:
            call = self._scanner.result("".join(self._raw))
            if call is not None:
                name, args = call
                self._deltas.append(ToolCallDelta(self._next_index, new_tool_call_id(), name, args))
                self._next_index += 1
            elif not drop:  # not a call: the block is content again, exactly as written
                raw = OPEN_TAG + "".join(self._raw) + (CLOSE_TAG if closed else tail)
                self._content.append(self._space_before + raw)
                self._after_block = False
        self._start_block()

    # ------------------------------------------------------------ forced calls

    @classmethod
    def grammar(cls, tools: list[dict], tool_choice: str | dict, parallel_tool_calls: bool,
                tag_tokens: Mapping[str, int]) -> str:
        names = forced_tool_names(tools, tool_choice)
        functions = {t["function"]["name"]: t["function"] for t in tools}
        alternatives = []
        for i, name in enumerate(names):
            alternatives.append({
                "type": "object",
                "properties": {
                    "name": {"const": name},
                    "arguments": arguments_schema(functions[name], f"#/anyOf/{i}/properties/arguments"),
                },
                "required": ["name", "arguments"],
                "additionalProperties": False,
            })
        body = {"x-guidance": JSON_COMPILE_OPTIONS, "anyOf": alternatives}
        return "\n".join([
            'start: call ("\\n" call)*' if parallel_tool_calls else "start: call",
            f'call: {lark_tag(OPEN_TAG, tag_tokens)} "\\n" body "\\n" {lark_tag(CLOSE_TAG, tag_tokens)}',
            "body: %json " + json.dumps(body),
        ])


