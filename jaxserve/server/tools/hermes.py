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
header delta goes out. A committed block that later proves malformed (bad JSON after that point,
a repeated key, no end before generation stops) stays a call whose arguments are what was streamed;
the rest of its block is dropped, whereas `parse` returns such a block as content. Before that
point streaming and `parse` decide identically, for every way the text is cut into chunks.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from jaxserve.server.tools.base import (
    JSON_COMPILE_OPTIONS,
    ToolCall,
    ToolCallDelta,
    ToolParser,
    arguments_schema,
    assemble_calls,
    forced_tool_names,
    lark_tag,
    new_tool_call_id,
)

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"
_WHITESPACE = " \t\n\r"


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

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        if self._in_block:
            # Cut off before its closing tag. What is held back is the start of that tag, cut off
            # too: not part of the JSON.
            held, self._held = self._held, ""
            self._end_block(closed=False, tail=held)
        else:
            held, self._held = self._held, ""
            if self._after_block:  # whitespace after a block is dropped, a partial tag is not
                held = held.lstrip(_WHITESPACE)
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
            before = buf[:at].lstrip(_WHITESPACE) if self._after_block else buf[:at]
            body = before.rstrip(_WHITESPACE)
            self._emit_content(body)
            self._in_block = True
            self._start_block()
            self._space_before = before[len(body):]  # given back if the block turns out to be content
            return buf[at + len(OPEN_TAG):]
        keep = len(buf) - _partial_tag_len(buf, OPEN_TAG)
        ready = buf[:keep]
        # Trailing whitespace waits too: if a tag follows it, it is dropped.
        body = ready.rstrip(_WHITESPACE)
        self._emit_content(body)
        self._held = ready[len(body):] + buf[keep:]
        return ""

    def _emit_content(self, text: str) -> None:
        if self._after_block:
            text = text.lstrip(_WHITESPACE)
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
        keep = len(buf) - _partial_tag_len(buf, CLOSE_TAG)
        self._scan(buf[:keep])
        self._held = buf[keep:]
        return ""

    # ------------------------------------------------------------ one block

    def _start_block(self) -> None:
        self._raw: list[str] = []          # the block's text after <tool_call>
        self._space_before = ""            # whitespace dropped before <tool_call>
        self._scanner = _CallScanner()
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

    def _end_block(self, closed: bool, tail: str = "") -> None:
        self._in_block = False
        self._after_block = True
        if self._committed is None:
            call = self._scanner.result("".join(self._raw))
            if call is not None:
                name, args = call
                self._deltas.append(ToolCallDelta(self._next_index, new_tool_call_id(), name, args))
                self._next_index += 1
            else:  # not a call: the block is content again, exactly as written
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


def _partial_tag_len(buf: str, tag: str) -> int:
    """Length of the longest end of `buf` that is a proper beginning of `tag` (maybe the tag's start)."""
    for n in range(min(len(buf), len(tag) - 1), 0, -1):
        if buf.endswith(tag[:n]):
            return n
    return 0


class _CallScanner:
    """Reads a block's JSON one character at a time: finds the top-level "name" and "arguments"
    values while they are written, so arguments can stream before the object is complete.

    It tracks nesting, strings and escapes, and the key/value structure of the outer object; it
    does not check numbers or literals (`result` runs json.loads for the final word).
    """

    def __init__(self) -> None:
        self.error = False
        self.closed = False        # the outer object has ended
        self.name: str | None = None
        self.ready = False         # the call is certain enough to announce (see _check_ready)
        self._stack: list[str] = []   # open brackets; the outer object is _stack[0]
        self._in_string = False
        self._escape = False
        self._expect = "object"       # in the outer object: key_or_end, key, colon, value, comma_or_end
        self._key: list[str] | None = None     # characters of the outer key being read
        self._value_key: str | None = None     # the outer key whose value is being read
        self._value_kind = ""                  # "string", "nested" or "scalar" while a value is read
        self._name_chars: list[str] | None = None
        self._args: list[str] = []             # one character per item
        self._args_kind = ""                   # first character class of the "arguments" value
        self._args_done = False
        self._seen: set[str] = set()

    def _check_ready(self) -> None:
        # Called where the answer can change. Sticky, and set at one character of the text, so
        # streaming commits at the same place however the text is chunked.
        if self.name is not None and (self._args_kind == "{" or (self.closed and "arguments" not in self._seen)):
            self.ready = True

    def arguments_from(self, start: int) -> str:
        """The arguments object's text read so far, from character `start` on: "" unless
        "arguments" is an object, "{}" once the outer object has closed without one."""
        if self._args_kind == "{":
            return "".join(self._args[start:])
        return "{}"[start:] if self.closed and "arguments" not in self._seen else ""

    def result(self, raw: str) -> tuple[str, str] | None:
        """(name, arguments text) if the block's text `raw` is a complete, valid call, else None."""
        if self.error or not self.closed or self.name is None:
            return None
        if "arguments" in self._seen and not (self._args_kind == "{" and self._args_done):
            return None
        try:
            json.loads(raw)
        except ValueError:
            return None
        return self.name, self.arguments_from(0)

    def feed(self, text: str) -> None:
        for ch in text:
            if self.error:
                return
            self._char(ch)

    def _char(self, ch: str) -> None:
        capture = self._value_key == "arguments" and self._value_kind != ""
        if self._in_string:
            self._string_char(ch, capture)
            return
        depth = len(self._stack)
        if depth == 0:
            if ch in _WHITESPACE:
                return
            if self.closed or ch != "{":
                self.error = True
                return
            self._stack.append("{")
            self._expect = "key_or_end"
            return
        if depth > 1:  # inside a nested value of the outer object
            if capture:
                self._args.append(ch)
            if ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._stack.append(ch)
            elif ch in "}]":
                if _OPENER[ch] != self._stack.pop():
                    self.error = True
                elif len(self._stack) == 1:
                    self._end_value()
            return
        self._outer_char(ch, capture)

    def _string_char(self, ch: str, capture: bool) -> None:
        if capture:
            self._args.append(ch)
        outer = len(self._stack) == 1
        if self._escape:
            self._escape = False
        elif ch == "\\":
            self._escape = True
        elif ch == '"':
            self._in_string = False
            if outer:  # a key or a string value of the outer object ended
                if self._key is not None:
                    self._end_key()
                else:
                    self._end_value()
            return
        if outer:  # raw characters, escapes included: json.loads decodes them at the end
            if self._key is not None:
                self._key.append(ch)
            elif self._name_chars is not None:
                self._name_chars.append(ch)

    def _outer_char(self, ch: str, capture: bool) -> None:
        """A character directly inside the outer object, outside strings."""
        if self._value_kind == "scalar":
            if ch not in _WHITESPACE and ch not in ",}":
                if capture:
                    self._args.append(ch)
                return
            self._end_value()
        if ch in _WHITESPACE:
            return
        expect = self._expect
        if expect in ("key_or_end", "key") and ch == '"':
            self._key = []
            self._in_string = True
        elif expect in ("key_or_end", "comma_or_end") and ch == "}":
            self._stack.pop()
            self.closed = True
            self._check_ready()
        elif expect == "colon" and ch == ":":
            self._expect = "value"
        elif expect == "comma_or_end" and ch == ",":
            self._expect = "key"
        elif expect == "value":
            self._start_value(ch)
        else:
            self.error = True

    def _end_key(self) -> None:
        try:
            key = json.loads('"' + "".join(self._key or []) + '"')
        except ValueError:
            self.error = True
            return
        self._key = None
        if key in ("name", "arguments"):
            if key in self._seen:
                self.error = True  # a repeated key: which one counts is not obvious
                return
            self._seen.add(key)
        self._value_key = key
        self._expect = "colon"

    def _start_value(self, ch: str) -> None:
        self._expect = "comma_or_end"
        if self._value_key == "arguments":
            self._args_kind = ch
            self._args.append(ch)
            self._check_ready()
        if ch == '"':
            self._value_kind = "string"
            self._in_string = True
            if self._value_key == "name":
                self._name_chars = []
        elif ch in "{[":
            self._value_kind = "nested"
            self._stack.append(ch)
        elif ch in "}],:":
            self.error = True
        else:
            self._value_kind = "scalar"

    def _end_value(self) -> None:
        if self._name_chars is not None:
            try:
                self.name = json.loads('"' + "".join(self._name_chars) + '"')
            except ValueError:
                self.error = True
            self._name_chars = None
            self._check_ready()
        if self._value_key == "arguments":
            self._args_done = True
        self._value_key = None
        self._value_kind = ""


_OPENER = {"}": "{", "]": "["}
