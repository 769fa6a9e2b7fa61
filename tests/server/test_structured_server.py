"""Structured output and forced tool calls through a real server and the official `openai` client:
every way of asking for a constraint, streamed and not, and the 400s for bad constraints and tools."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from server_utils import MODEL, LiveServer, client_for, start_server
from structured_cases import MSG, PERSON, SCHEMAS, TOOLS, stream_chunks, tool_stream


class Pet(BaseModel):
    name: str = Field(max_length=6)
    legs: int = Field(ge=0, le=8)
    kind: str = Field(pattern="^(cat|dog|bird)$")


@pytest.fixture(scope="module")
def live(loaded_model) -> LiveServer:
    server = start_server(loaded_model)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(live) -> openai.OpenAI:
    return client_for(live)


# --- constraints -------------------------------------------------------------------------------


def test_json_schema_response_format_validates_on_chat_and_completions(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    chat = client.chat.completions.create(model=MODEL, messages=MSG, response_format=fmt, n=8, temperature=1.0,
                                          seed=1, max_tokens=60)
    completion = client.completions.create(model=MODEL, prompt="A person:", n=8, temperature=1.0, seed=2,
                                           max_tokens=60, extra_body={"response_format": fmt})
    texts = [c.message.content for c in chat.choices] + [c.text for c in completion.choices]
    for choice in [*chat.choices, *completion.choices]:
        assert choice.finish_reason == "stop"
    for text in texts:
        jsonschema.validate(json.loads(text), PERSON)
    assert len(set(texts)) > 4


def test_parse_with_a_pydantic_model(client):
    for seed in range(2):
        out = client.chat.completions.parse(model=MODEL, messages=MSG, response_format=Pet, temperature=1.0,
                                            seed=seed, max_tokens=60)
        pet = out.choices[0].message.parsed
        assert isinstance(pet, Pet), out.choices[0].message.content
        assert pet.kind in ("cat", "dog", "bird") and 0 <= pet.legs <= 8


def test_json_object_gives_a_json_object(client):
    out = client.chat.completions.create(model=MODEL, messages=MSG, response_format={"type": "json_object"},
                                         temperature=1.0, seed=3, max_tokens=60, n=2)
    for c in out.choices:
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.message.content), dict)
        else:  # a random model may write a long object: cut off, it is still the start of one
            assert c.finish_reason == "length" and c.message.content.startswith("{")


@pytest.mark.parametrize("extra, check", [
    ({"structured_outputs": {"regex": "[a-z]{3}-[0-9]{2}"}}, lambda t: re.fullmatch("[a-z]{3}-[0-9]{2}", t)),
    ({"guided_regex": "(yes|no)!"}, lambda t: t in ("yes!", "no!")),
    ({"structured_outputs": {"choice": ["red", "green", "blue"]}}, lambda t: t in ("red", "green", "blue")),
    ({"guided_choice": ["one", "two"]}, lambda t: t in ("one", "two")),
    ({"structured_outputs": {"json": PERSON}}, lambda t: jsonschema.validate(json.loads(t), PERSON) is None),
    ({"guided_json": json.dumps(PERSON)}, lambda t: jsonschema.validate(json.loads(t), PERSON) is None),
    ({"guided_grammar": 'start: "(" NUM ("+" NUM)* ")"\nNUM: /[0-9]{1,2}/'},
     lambda t: re.fullmatch(r"\([0-9]{1,2}(\+[0-9]{1,2})*\)", t)),
    ({"structured_outputs": {"grammar": 'root ::= "x" [0-9] [0-9]?'}}, lambda t: re.fullmatch("x[0-9]{1,2}", t)),
])
def test_structured_outputs_and_guided_fields(client, extra, check):
    out = client.completions.create(model=MODEL, prompt="Go:", n=4, temperature=1.0, seed=4, max_tokens=60,
                                    extra_body=extra)
    for c in out.choices:
        assert c.finish_reason == "stop" and check(c.text), c.text


def test_streamed_constrained_output_equals_the_non_streamed_one(live, client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    body = {"messages": MSG, "response_format": fmt, "temperature": 1.0, "seed": 5, "max_tokens": 60}
    full = client.chat.completions.create(model=MODEL, **body)
    deltas = [e["choices"][0]["delta"].get("content") or "" for e in stream_chunks(live, "chat/completions", body)
              if e["choices"]]
    assert "".join(deltas) == full.choices[0].message.content
    jsonschema.validate(json.loads(full.choices[0].message.content), PERSON)


def test_max_tokens_cuts_a_schema_with_length(client):
    out = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=3, temperature=0,
                                         response_format={"type": "json_schema",
                                                          "json_schema": {"name": "p", "schema": PERSON}})
    assert out.choices[0].finish_reason == "length"
    assert out.choices[0].message.content.startswith("{")


# --- tools -------------------------------------------------------------------------------------


@pytest.mark.parametrize("tool_choice, names", [
    ("required", {"get_weather", "get_time"}),
    ({"type": "function", "function": {"name": "get_time"}}, {"get_time"}),
])
def test_forced_tool_calls_validate_and_stream_as_openai_does(live, client, tool_choice, names):
    body = {"messages": [{"role": "user", "content": "Weather?"}], "tools": TOOLS, "tool_choice": tool_choice,
            "temperature": 0, "max_tokens": 120}
    full = client.chat.completions.create(model=MODEL, **body)
    choice = full.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    assert not choice.message.content
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id.startswith("call") and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    streamed, finish, content = tool_stream(live, body)
    assert finish == "tool_calls" and not content.strip()
    assert [(c["name"], c["arguments"]) for c in streamed] == \
        [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]


def test_parallel_tool_calls_false_gives_one_call_and_sampling_stays_valid(client):
    for seed in range(2):
        out = client.chat.completions.create(model=MODEL, messages=MSG, tools=TOOLS, tool_choice="required",
                                             parallel_tool_calls=False, temperature=1.0, seed=seed, max_tokens=120)
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
        call = choice.message.tool_calls[0]
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_tool_results_go_back_through_the_template(client):
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"}]
    out = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="none",
                                         temperature=0, max_tokens=4)
    assert out.choices[0].finish_reason in ("stop", "length")
    assert out.usage.prompt_tokens > 40  # the tools, the call and its result were all rendered


# --- bad input ---------------------------------------------------------------------------------


BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "strin"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": PERSON}}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs"),
    ({"structured_outputs": {"grammar": "start: expr\nexpr: NUMBER +"}}, "structured_outputs"),
    ({"structured_outputs": {"yaml": "x"}}, "structured_outputs"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS}, "tool_choice"),  # auto needs --enable-auto-tool-choice
    ({"tools": [{"type": "function", "function": {"parameters": {}}}], "tool_choice": "required"}, "tools"),
    ({"tools": [{"type": "retrieval"}], "tool_choice": "required"}, "tools"),
    ({"tools": "get_weather", "tool_choice": "required"}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objec"}}}],
      "tool_choice": "required"}, "tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
]


@pytest.mark.parametrize("extra, field", BAD)
def test_bad_constraints_and_tools_are_400s_naming_the_field(live, extra, field):
    before = live.metrics()["jaxserve:prompt_tokens_total"]
    r = httpx.post(f"{live.url}/v1/chat/completions", json={"model": MODEL, "messages": MSG, **extra}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == field, error
    assert error["message"]
    assert live.metrics()["jaxserve:prompt_tokens_total"] == before  # it never reached the engine
