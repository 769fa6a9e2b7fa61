"""Incremental scanning of a tool call's JSON as it streams: where the function name ends and the
arguments object begins, how much of the arguments can be released, and whether the call is
complete, without re-parsing the text seen so far."""

from __future__ import annotations

import json

WHITESPACE = " \t\n\r"


def partial_tag_len(buf: str, tag: str) -> int:
    """Length of the longest end of `buf` that is a proper beginning of `tag` (maybe the tag's start)."""
    for n in range(min(len(buf), len(tag) - 1), 0, -1):
        if buf.endswith(tag[:n]):
            return n
    return 0


class CallScanner:
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
            if ch in WHITESPACE:
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
            if ch not in WHITESPACE and ch not in ",}":
                if capture:
                    self._args.append(ch)
                return
            self._end_value()
        if ch in WHITESPACE:
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
