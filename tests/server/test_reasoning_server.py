"""A server with --reasoning-parser qwen3: reasoning comes back apart from the answer, and a
response format applies only after the reasoning ends."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from server_utils import MODEL, LiveServer, client_for, start_server
from structured_cases import MSG, PERSON, stream_chunks


@pytest.fixture(scope="module")
def live_reasoning(loaded_model) -> LiveServer:
    server = start_server(loaded_model, reasoning_parser="qwen3")
    yield server
    server.stop()


def test_response_format_applies_after_the_reasoning(live_reasoning, loaded_model):
    """Biased toward the think tags, the model opens and closes a (here empty) reasoning block; the
    JSON schema applies only after it, and the tags never reach the content. (Every split of real
    reasoning text is covered by test_reasoning.py.)"""
    hf = loaded_model[1].hf
    bias = {str(hf.convert_tokens_to_ids(t)): 100 for t in ("<think>", "</think>")}
    body = {"messages": MSG, "temperature": 0, "max_tokens": 60, "logit_bias": bias, "logprobs": True,
            "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}}
    r = httpx.post(f"{live_reasoning.url}/v1/chat/completions", json={"model": MODEL, **body}, timeout=300)
    choice = r.json()["choices"][0]
    message = choice["message"]
    tokens = [t["token"] for t in choice["logprobs"]["content"]]
    assert tokens[:2] == ["<think>", "</think>"], tokens  # the model did reason (briefly)
    jsonschema.validate(json.loads(message["content"]), PERSON)
    assert "reasoning_content" in message and "think>" not in message["content"]
    reasoning, content = "", ""
    for e in stream_chunks(live_reasoning, "chat/completions", body):
        if e["choices"]:
            reasoning += e["choices"][0]["delta"].get("reasoning_content") or ""
            content += e["choices"][0]["delta"].get("content") or ""
    assert content == message["content"] and reasoning == (message["reasoning_content"] or "")


def test_enable_thinking_false_answers_without_reasoning(live_reasoning):
    out = client_for(live_reasoning).chat.completions.create(
        model=MODEL, messages=MSG, temperature=1.0, seed=6, max_tokens=60,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}},
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    message = out.choices[0].message
    jsonschema.validate(json.loads(message.content), PERSON)
    assert getattr(message, "reasoning_content", None) in (None, "")


