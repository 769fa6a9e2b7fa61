"""Shared by the structured-output, tool and reasoning server tests: schemas, tools, and
SSE readers that check OpenAI's streaming shapes. (One module per server configuration: servers
of the session share one engine core, so two must never run at once.)"""

from __future__ import annotations

import httpx

from server_utils import MODEL, LiveServer, read_sse

MSG = [{"role": "user", "content": "Answer."}]
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 8},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "additionalProperties": False, "required": ["zone"],
                                       "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}}}}}
TOOLS = [WEATHER, CLOCK]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
HAND_WRITTEN_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'


def stream_chunks(server: LiveServer, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{server.url}/v1/{path}", json={"model": MODEL, **body, "stream": True},
                      timeout=300) as r:
        assert r.status_code == 200, r.read()
        events = read_sse(r)
    assert events[-1] == "[DONE]"
    return events[:-1]


def tool_streams(server: LiveServer, body: dict) -> list[tuple[list[dict], str | None, str]]:
    """Per choice, in index order: (calls assembled from the deltas, finish_reason, content),
    checking OpenAI's delta order."""
    calls: dict[int, dict[int, dict]] = {}
    finish: dict[int, str | None] = {}
    content: dict[int, str] = {}
    for event in stream_chunks(server, "chat/completions", body):
        if not event["choices"]:
            continue
        choice = event["choices"][0]
        i = choice["index"]
        delta = choice["delta"]
        content[i] = content.get(i, "") + (delta.get("content") or "")
        mine = calls.setdefault(i, {})
        for d in delta.get("tool_calls") or []:
            if d["index"] not in mine:  # the first delta of a call names it
                assert d["id"].startswith("call") and d["type"] == "function" and d["function"]["name"]
                mine[d["index"]] = {"id": d["id"], "name": d["function"]["name"], "arguments": ""}
            else:
                assert "id" not in d and "name" not in d.get("function", {})
            mine[d["index"]]["arguments"] += d["function"].get("arguments") or ""
        finish[i] = choice.get("finish_reason") or finish.get(i)
    assert sorted(content) == list(range(len(content)))
    out = []
    for i in sorted(content):
        assert sorted(calls[i]) == list(range(len(calls[i])))
        out.append(([calls[i][k] for k in sorted(calls[i])], finish[i], content[i]))
    return out


def tool_stream(server: LiveServer, body: dict) -> tuple[list[dict], str | None, str]:
    """(calls assembled from the deltas, finish_reason, content) of a one-choice request."""
    (only,) = tool_streams(server, body)
    return only
