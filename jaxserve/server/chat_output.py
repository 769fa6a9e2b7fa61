"""One chat choice's generated text -> OpenAI message fields: reasoning_content, content, tool_calls.

The reasoning parser (if the server has one) splits the thinking off first; the rest goes through
the tool parser when the request's tools may be called. Streaming feeds each text delta through the
same parsers a whole response uses (`message()` is feed + finish on fresh parsers), so the streamed
fields concatenate to the non-streamed ones. When the tool choice is forced the grammar made the
output calls, so `message()` reports exactly what the stream sends (a call cut off by max_tokens is
still that call) instead of the tool parser's stricter reading of free text; so does an answer cut
by max_tokens (`truncated`), where a call not yet announced is dropped: its markup is never content.
"""

from __future__ import annotations

from typing import Any

from jaxserve.server.tools.base import ToolCall, ToolCallDelta


class ChoiceOutput:
    def __init__(self, reasoning_cls: type | None, tool_cls: type | None, tools: list[dict] | None,
                 prompt_text: str = "", forced: bool = False) -> None:
        self._reasoning_cls, self._tool_cls, self._tools = reasoning_cls, tool_cls, tools
        self._prompt_text, self._forced = prompt_text, forced
        self._reasoning = reasoning_cls(prompt_text) if reasoning_cls is not None else None
        self._calls = tool_cls(tools) if tool_cls is not None else None
        self.made_tool_calls = False

    @property
    def plain(self) -> bool:
        """No parser applies: the text is the content, as is."""
        return self._reasoning is None and self._calls is None

    def feed(self, text: str) -> dict[str, Any]:
        """Delta fields for a chunk (empty when everything is held back)."""
        return self._delta(*self._split(text, final=False))

    def finish(self, truncated: bool = False) -> dict[str, Any]:
        """The last delta; truncated: generation stopped at max_tokens (a call being written is cut)."""
        return self._delta(*self._split("", final=True, truncated=truncated))

    def message(self, text: str, truncated: bool = False) -> dict[str, Any]:
        """The whole assistant message for `text` (fresh parsers: independent of any stream);
        truncated: it stopped at max_tokens, so it is read as its stream was (a cut call never
        leaks its markup into content)."""
        out = ChoiceOutput(self._reasoning_cls, self._tool_cls, self._tools, self._prompt_text, self._forced)
        reasoning, content = None, text
        if out._reasoning is not None:
            reasoning, content = out._reasoning.parse(text)
        calls: list[ToolCall] = []
        if out._calls is not None:
            if self._forced or truncated:
                content, calls = out._calls.parse_as_streamed(content or "", truncated)
            else:
                content, calls = out._calls.parse(content or "")
        if not content:  # OpenAI: null beside tool calls; vLLM: null when everything was reasoning
            content = None if calls or out._reasoning is not None else ""
        msg: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None}
        if out._reasoning is not None:
            msg["reasoning_content"] = reasoning
        if calls:
            msg["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
        return msg

    def _split(self, text: str, final: bool, truncated: bool = False) -> tuple[str, str, list[ToolCallDelta]]:
        reasoning, content = "", text
        if self._reasoning is not None:
            d = self._reasoning.finish() if final else self._reasoning.feed(text)
            reasoning, content = d.reasoning, d.content
        calls: list[ToolCallDelta] = []
        if self._calls is not None:
            content, calls = self._calls.feed(content) if content else ("", [])
            if final:
                more, tail = self._calls.finish(truncated)
                content, calls = content + more, calls + tail
        return reasoning, content, calls

    def _delta(self, reasoning: str, content: str, calls: list[ToolCallDelta]) -> dict[str, Any]:
        delta: dict[str, Any] = {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        if content:
            delta["content"] = content
        if calls:
            self.made_tool_calls = True
            delta["tool_calls"] = [_call_delta(c) for c in calls]
        return delta


def finish_reason(reason: str | None, made_tool_calls: bool) -> str | None:
    """OpenAI reports a stop that produced tool calls as "tool_calls"."""
    return "tool_calls" if reason == "stop" and made_tool_calls else reason


def _call_delta(c: ToolCallDelta) -> dict[str, Any]:
    """OpenAI's streamed tool-call shape: index, then id/type/name on a call's first delta."""
    out: dict[str, Any] = {"index": c.index}
    function: dict[str, Any] = {}
    if c.id is not None:
        out["id"] = c.id
        out["type"] = "function"
    if c.name is not None:
        function["name"] = c.name
    function["arguments"] = c.arguments
    out["function"] = function
    return out
