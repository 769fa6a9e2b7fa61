"""tool_choice "auto" and "none" on a server started with --enable-auto-tool-choice
--tool-call-parser hermes: a `<tool_call>` block the model writes (here forced by a choice
constraint) becomes `tool_calls`, streamed and not; without one, or with "none", it is content."""

from __future__ import annotations

import json

import httpx
import pytest

from server_utils import MODEL, LiveServer, client_for, start_server
from structured_cases import HAND_WRITTEN_CALL, MSG, TOOLS, tool_stream


@pytest.fixture(scope="module")
def live_auto(loaded_model) -> LiveServer:
    server = start_server(loaded_model, enable_auto_tool_choice=True, tool_call_parser="hermes")
    yield server
    server.stop()


def test_auto_parses_a_tool_call_block_streamed_and_not(live_auto):
    body = {"messages": MSG, "tools": TOOLS, "tool_choice": "auto", "temperature": 0, "max_tokens": 80,
            "structured_outputs": {"choice": [HAND_WRITTEN_CALL]}}
    out = client_for(live_auto).chat.completions.create(model=MODEL, **{k: v for k, v in body.items()
                                                                     if k != "structured_outputs"},
                                                     extra_body={"structured_outputs": body["structured_outputs"]})
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "celsius"}
    streamed, finish, content = tool_stream(live_auto, body)
    assert finish == "tool_calls" and not content
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed] == [("get_weather", json.loads(call.function.arguments))]


def test_auto_without_a_call_is_plain_content(live_auto):
    out = client_for(live_auto).chat.completions.create(model=MODEL, messages=MSG, tools=TOOLS, temperature=0,
                                                      max_tokens=12, extra_body={"guided_choice": ["It is sunny."]})
    choice = out.choices[0]
    assert choice.message.content == "It is sunny." and not choice.message.tool_calls
    assert choice.finish_reason == "stop"


def test_none_never_returns_tool_calls(live_auto):
    for stream in (False, True):
        body = {"messages": MSG, "tools": TOOLS, "tool_choice": "none", "temperature": 0, "max_tokens": 80,
                "guided_choice": [HAND_WRITTEN_CALL]}
        if stream:
            calls, finish, content = tool_stream(live_auto, body)
        else:
            r = httpx.post(f"{live_auto.url}/v1/chat/completions", json={"model": MODEL, **body}, timeout=300)
            choice = r.json()["choices"][0]
            calls, finish, content = choice["message"].get("tool_calls") or [], choice["finish_reason"], \
                choice["message"]["content"]
        assert not calls and finish == "stop" and content == HAND_WRITTEN_CALL


