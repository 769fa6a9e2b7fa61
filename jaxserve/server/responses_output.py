"""Generated text -> Responses output items (reasoning, message, function_call) and the semantic
stream events that build them, in OpenAI's order.

`OutputBuilder` reads the text through the chat path's parsers (`ChoiceOutput`: reasoning first,
then tool calls) delta by delta, and opens an item whenever the kind of text changes: reasoning
text opens a reasoning item, answer text a message item, a call's first delta a function_call item.
Opening one closes the item before it (its `.done` events), so items never interleave. A streamed
response sends the events; a whole response feeds the same deltas and keeps only the items, which
is why the two agree token for token.

Event dicts carry no `sequence_number`; the stream numbers them as it sends them.
"""

from __future__ import annotations

import uuid
from typing import Any

from jaxserve.server.chat_output import ChoiceOutput

Event = dict[str, Any]


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputBuilder:
    def __init__(self, choice: ChoiceOutput) -> None:
        self._choice = choice
        self.items: list[dict] = []           # every item so far; the last may still be open
        self._open: dict | None = None        # the item being written
        self._call_items: dict[int, dict] = {}  # tool-call index -> its function_call item
        self._fed = 0                         # deltas fed: one per generated token
        self._answer_at: int | None = None    # deltas fed before the first answer item opened

    def feed(self, text: str) -> list[Event]:
        """The events of one engine delta (call it for every delta, empty ones too: they count tokens)."""
        self._fed += 1
        return self._apply(self._choice.feed(text)) if text else []

    @property
    def reasoning_tokens(self) -> int:
        """The tokens generated before the answer began, when there was reasoning (tag tokens included)."""
        if not any(item["type"] == "reasoning" for item in self.items):
            return 0
        return self._fed if self._answer_at is None else self._answer_at

    def finish(self, truncated: bool) -> list[Event]:
        """The last text held back by the parsers, then the open item's closing events; truncated:
        the output stopped at max_output_tokens, so the open item is "incomplete"."""
        events = self._apply(self._choice.finish(truncated))
        return events + self._close("incomplete" if truncated else "completed")

    # ------------------------------------------------------------ deltas -> events

    def _apply(self, delta: dict[str, Any]) -> list[Event]:
        events: list[Event] = []
        if delta.get("reasoning_content"):
            events += self._text("reasoning", delta["reasoning_content"])
        if delta.get("content"):
            events += self._text("message", delta["content"])
        for call in delta.get("tool_calls", ()):
            events += self._call(call)
        return events

    def _text(self, kind: str, text: str) -> list[Event]:
        events: list[Event] = []
        item = self._open
        if item is None or item["type"] != kind:
            events += self._close("completed")
            item = self._add(_reasoning_item() if kind == "reasoning" else _message_item())
            events.append(self._added(item))
            events.append({"type": "response.content_part.added", **self._where(item, 0),
                           "part": _part(kind, "")})
        part = item["content"][0]
        part["text"] += text
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        event: Event = {"type": name, **self._where(item, 0), "delta": text}
        if kind == "message":
            event["logprobs"] = []
        events.append(event)
        return events

    def _call(self, call: dict[str, Any]) -> list[Event]:
        events: list[Event] = []
        fragment = call["function"].get("arguments", "")
        item = self._call_items.get(call["index"])
        if item is None:  # a call's first delta names it
            events += self._close("completed")
            item = self._add({"id": item_id("fc"), "type": "function_call", "status": "in_progress",
                              "call_id": call.get("id") or item_id("call"), "name": call["function"].get("name", ""),
                              "arguments": ""})
            self._call_items[call["index"]] = item
            events.append(self._added(item))
        if fragment:
            item["arguments"] += fragment
            events.append({"type": "response.function_call_arguments.delta", "item_id": item["id"],
                           "output_index": self._index(item), "delta": fragment})
        return events

    def _close(self, status: str) -> list[Event]:
        item, self._open = self._open, None
        if item is None:
            return []
        item["status"] = status
        where = {"item_id": item["id"], "output_index": self._index(item)}
        if item["type"] == "function_call":
            events = [{"type": "response.function_call_arguments.done", **where, "name": item["name"],
                       "arguments": item["arguments"]}]
        else:
            part = item["content"][0]
            reasoning = item["type"] == "reasoning"
            done: Event = {"type": "response.reasoning_text.done" if reasoning else "response.output_text.done",
                           **where, "content_index": 0, "text": part["text"]}
            if not reasoning:
                done["logprobs"] = []
            events = [done, {"type": "response.content_part.done", **where, "content_index": 0, "part": dict(part)}]
        events.append({"type": "response.output_item.done", "output_index": where["output_index"],
                       "item": _copy(item)})
        return events

    # ------------------------------------------------------------ helpers

    def _add(self, item: dict) -> dict:
        if item["type"] != "reasoning" and self._answer_at is None:
            self._answer_at = max(self._fed - 1, 0)
        self.items.append(item)
        self._open = item
        return item

    def _index(self, item: dict) -> int:
        return next(i for i, x in enumerate(self.items) if x is item)

    def _added(self, item: dict) -> Event:
        return {"type": "response.output_item.added", "output_index": self._index(item), "item": _copy(item)}

    def _where(self, item: dict, content_index: int) -> dict[str, Any]:
        return {"item_id": item["id"], "output_index": self._index(item), "content_index": content_index}


def _message_item() -> dict:
    return {"id": item_id("msg"), "type": "message", "role": "assistant", "status": "in_progress",
            "content": [_part("message", "")]}


def _reasoning_item() -> dict:
    return {"id": item_id("rs"), "type": "reasoning", "status": "in_progress", "summary": [],
            "content": [_part("reasoning", "")]}


def _part(kind: str, text: str) -> dict:
    if kind == "reasoning":
        return {"type": "reasoning_text", "text": text}
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _copy(item: dict) -> dict:
    """A snapshot of an item for an event; an item just added shows no content yet, as OpenAI's do."""
    out = {**item}
    if "content" in item:
        out["content"] = [dict(p) for p in item["content"]] if item["status"] != "in_progress" else []
    return out


# ---------------------------------------------------------------- the response object


def response_object(rid: str, created_at: int, model: str, echo: dict[str, Any], status: str,
                    output: list[dict], usage: dict | None, previous_response_id: str | None,
                    store: bool) -> dict:
    """The `response` object (status: in_progress | completed | incomplete); `echo`: the request's
    fields it repeats (ResponsesRequest.echo)."""
    return {"id": rid, "object": "response", "created_at": created_at, "status": status,
            "background": False, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": echo["instructions"], "max_output_tokens": echo["max_output_tokens"],
            "max_tool_calls": None, "metadata": echo["metadata"] or {}, "model": model, "output": output,
            "parallel_tool_calls": echo["parallel_tool_calls"], "previous_response_id": previous_response_id,
            "reasoning": echo["reasoning"], "service_tier": "default", "store": store,
            "temperature": echo["temperature"], "text": echo["text"], "tool_choice": echo["tool_choice"],
            "tools": echo["tools"], "top_logprobs": 0, "top_p": echo["top_p"], "truncation": "disabled",
            "usage": usage, "user": echo["user"]}


def usage(input_tokens: int, output_tokens: int, cached_tokens: int, reasoning_tokens: int) -> dict:
    # cache_write_tokens: OpenAI bills explicit cache writes; a local prefix cache writes nothing billed.
    return {"input_tokens": input_tokens, "output_tokens": output_tokens, "total_tokens": input_tokens + output_tokens,
            "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens}}


def as_messages(output: list[dict]) -> list[dict]:
    """A response's output items as the chat messages of its assistant turn (for previous_response_id)."""
    message: dict[str, Any] = {"role": "assistant", "content": ""}
    for item in output:
        if item["type"] == "reasoning":
            message["reasoning_content"] = message.get("reasoning_content", "") + item["content"][0]["text"]
        elif item["type"] == "message":
            message["content"] += item["content"][0]["text"]
        elif item["type"] == "function_call":
            message.setdefault("tool_calls", []).append(
                {"id": item["call_id"], "type": "function",
                 "function": {"name": item["name"], "arguments": item["arguments"]}})
    return [message]
