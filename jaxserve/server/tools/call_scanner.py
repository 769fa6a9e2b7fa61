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


DIGITS = "0123456789"
HEX = DIGITS + "abcdefABCDEF"
LITERALS = {"t": "true", "f": "false", "n": "null"}
NUMBER_ENDS = frozenset(("zero", "int", "frac", "exp"))  # states where a number may end
OPENER = {"}": "{", "]": "["}


def number_step(state: str, ch: str) -> str | None:
    """The JSON number grammar, one character at a time: the next state, or None where `ch` cannot
    continue the number (it then ends there if `state` is in NUMBER_ENDS, else it is malformed)."""
    digit = ch in DIGITS
    if state in ("start", "sign"):
        return "zero" if ch == "0" else "int" if digit else "sign" if state == "start" and ch == "-" else None
    if state in ("zero", "int"):
        return ("int" if digit and state == "int" else "dot" if ch == "." else "e" if ch in "eE" else None)
    if state in ("dot", "frac"):
        return "frac" if digit else "e" if state == "frac" and ch in "eE" else None
    if state == "e":
        return "esign" if ch in "+-" else "exp" if digit else None
    return "exp" if digit else None  # esign, exp


class CallScanner:
    """Reads a block's JSON one character at a time: checks it against the JSON grammar as it
    comes (so a malformed character is caught where it is written, not when the block ends), and
    finds the top-level "name" and "arguments" values, so arguments can stream before the object is
    complete and stop at the last character that kept them a valid beginning of JSON.

    Work per character is constant (a number or literal is checked by a small state machine).
    `result` still runs json.loads once for the final word.
    """

    def __init__(self) -> None:
        self.error = False
        self.closed = False        # the outer object has ended
        self.name: str | None = None
        self.ready = False         # the call is certain enough to announce (see _check_ready)
        # One [bracket, expected token] per open container; the outer object is _frames[0]. Expected:
        # key_or_end, key, colon, value, value_or_end (an array's first), comma_or_end.
        self._frames: list[list[str]] = []
        self._in_string = False
        self._string_is_key = False
        self._escape = 0                       # 0, -1 right after a backslash, n: hex digits of \u left
        self._number: str | None = None        # number_step state while a number is read
        self._literal = ""                     # the literal being read ("true"...), and how far
        self._literal_at = 0
        self._key: list[str] | None = None     # characters of an outer key being read
        self._value_key: str | None = None     # the outer key whose value is being read
        self._name_chars: list[str] | None = None
        self._args: list[str] = []             # one character per item
        self._args_kind = ""                   # first character of the "arguments" value
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
            inside = self._args_kind == "{" and not self._args_done
            if not self._char(ch):
                self.error = True  # nothing of this character is kept
                return
            if inside or (self._args_kind == "{" and not self._args):
                self._args.append(ch)

    def _char(self, ch: str) -> bool:
        """Advances over one character; False where it breaks the JSON grammar."""
        if self._in_string:
            return self._string_char(ch)
        if self._number is not None:
            step = number_step(self._number, ch)
            if step is not None:
                self._number = step
                return True
            if self._number not in NUMBER_ENDS:
                return False
            self._number = None
            self._end_value()  # the number ended just before `ch`, which is read below
        elif self._literal:
            if self._literal_at < len(self._literal):
                if ch != self._literal[self._literal_at]:
                    return False
                self._literal_at += 1
                return True
            self._literal = ""
            self._end_value()
        if ch in WHITESPACE:
            return True
        if not self._frames:
            if self.closed or ch != "{":
                return False
            self._frames.append(["{", "key_or_end"])
            return True
        frame = self._frames[-1]
        bracket, expect = frame
        if ch in "}]":
            if OPENER[ch] != bracket or expect not in ("key_or_end", "value_or_end", "comma_or_end"):
                return False
            self._frames.pop()
            if self._frames:
                self._end_value()
            else:
                self.closed = True
                self._check_ready()
            return True
        if expect == "colon":
            frame[1] = "value"
            return ch == ":"
        if expect == "comma_or_end":
            frame[1] = "key" if bracket == "{" else "value"
            return ch == ","
        if expect in ("key_or_end", "key"):
            if ch != '"':
                return False
            frame[1] = "colon"
            self._in_string, self._string_is_key = True, True
            if len(self._frames) == 1:
                self._key = []
            return True
        return self._start_value(ch)

    def _string_char(self, ch: str) -> bool:
        if self._escape:
            if self._escape == -1:
                if ch not in 'u"\\/bfnrt':
                    return False
                self._escape = 4 if ch == "u" else 0
            elif ch not in HEX:
                return False
            else:
                self._escape -= 1
        elif ch == "\\":
            self._escape = -1
        elif ch == '"':
            self._in_string = False
            if not self._string_is_key:
                self._end_value()
            elif self._key is not None:
                return self._end_key()
            return True
        elif ch < " ":  # control characters must be escaped
            return False
        # raw characters, escapes included: json.loads decodes them
        if self._key is not None:
            self._key.append(ch)
        elif self._name_chars is not None:
            self._name_chars.append(ch)
        return True

    def _end_key(self) -> bool:
        key = json.loads('"' + "".join(self._key or []) + '"')
        self._key = None
        if key in ("name", "arguments"):
            if key in self._seen:
                return False  # a repeated key: which one counts is not obvious
            self._seen.add(key)
        self._value_key = key
        return True

    def _start_value(self, ch: str) -> bool:
        self._frames[-1][1] = "comma_or_end"  # once this value has ended
        outer = len(self._frames) == 1
        if ch == '"':
            self._in_string, self._string_is_key = True, False
            if outer and self._value_key == "name":
                self._name_chars = []
        elif ch in "{[":
            self._frames.append([ch, "key_or_end" if ch == "{" else "value_or_end"])
        elif ch in LITERALS:
            self._literal, self._literal_at = LITERALS[ch], 1
        else:
            self._number = number_step("start", ch)
            if self._number is None:
                return False
        if outer and self._value_key == "arguments":
            self._args_kind = ch
            self._check_ready()
        return True

    def _end_value(self) -> None:
        """A value has ended; of the outer object's, "name" and "arguments" are kept."""
        if len(self._frames) != 1:
            return
        if self._name_chars is not None:
            self.name = json.loads('"' + "".join(self._name_chars) + '"')
            self._name_chars = None
            self._check_ready()
        if self._value_key == "arguments":
            self._args_done = True
        self._value_key = None
