"""Issue 48: a forced tool choice ("required", a named function) answers with `tool_calls` and
finish_reason "tool_calls" (or "length" when cut), streamed and not, whatever the checkpoint: a
chat template that renders tools or one that ignores them, Hermes tags held as added tokens, as
special tokens, or not at all (tool_checkpoints.py); for every registered tool parser, and on a
server started without --tool-call-parser. "auto" and "none" on the same checkpoints.

Real uvicorn servers and the official openai client, around the session's engine core: only the
tokenizer differs between the servers of this module (one runs at a time)."""

from __future__ import annotations

import concurrent.futures
import json

import jsonschema
import openai
import pytest

from jaxserve.server.tools import TOOL_PARSERS
from jaxserve.text.tokenizer import Tokenizer
from server_utils import MODEL, LiveServer, client_for, start_server
from structured_cases import MSG, SCHEMAS, TOOLS, tool_streams
from tool_checkpoints import CHECKPOINTS, checkpoint

# Every (checkpoint, parser) pair, auto enabled; then a server without --tool-call-parser, whose
# forced calls use the default format (hermes) and are parsed by it.
SERVERS = [(ckpt, parser) for ckpt in CHECKPOINTS for parser in TOOL_PARSERS] + [("plain-special", None)]

# The call of the issue: two tools, "required", sampled. The schemas are bounded so that a model
# with random weights finishes its calls well within max_tokens.
GET_WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {
        "type": "object", "additionalProperties": False, "required": ["city", "unit"],
        "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}}}}}
ADD = {"type": "function", "function": {
    "name": "add", "parameters": {
        "type": "object", "additionalProperties": False, "required": ["a", "b"],
        "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                       "b": {"type": "integer", "minimum": 0, "maximum": 99}}}}}
ISSUE_SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (GET_WEATHER, ADD)}
NAMED = {"type": "function", "function": {"name": "get_time"}}


@pytest.fixture(scope="module", params=SERVERS, ids=lambda p: f"{p[0]}-{p[1] or 'no-parser'}")
def live(request, loaded_model, tmp_path_factory) -> LiveServer:
    ckpt, parser = request.param
    core, tiny_tokenizer, tiny_dir = loaded_model
    model_dir = checkpoint(ckpt, tiny_dir, tmp_path_factory.mktemp("ckpt"))
    tokenizer = tiny_tokenizer if ckpt == "tiny" else Tokenizer.from_pretrained(model_dir)
    config = dict(enable_auto_tool_choice=True, tool_call_parser=parser) if parser else {}
    server = start_server((core, tokenizer, model_dir), **config)
    yield server
    server.stop()


def chat(live: LiveServer, **body):
    """The non-streamed answer through the openai client, and the streamed one's choices.

    Both requests run at once: the engine batches them, which halves the wait, and a row's output
    does not depend on what else is in the batch (server_utils.TEST_ENGINE)."""
    extra = {k: body.pop(k) for k in ("structured_outputs",) if k in body}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        full = pool.submit(client_for(live).chat.completions.create, model=MODEL, extra_body=extra or None, **body)
        streamed = tool_streams(live, {**body, **extra})
        return full.result(), streamed


def calls_of(message) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or []]


def assert_same_as_streamed(full, streamed) -> None:
    """The streamed deltas reassemble to the non-streamed message, choice by choice."""
    assert len(streamed) == len(full.choices)
    for choice, (calls, finish, content) in zip(full.choices, streamed):
        assert [(c["name"], c["arguments"]) for c in calls] == calls_of(choice.message)
        assert finish == choice.finish_reason and content == (choice.message.content or "")


def test_the_call_of_the_issue_returns_valid_tool_calls(live):
    # seed 2 rather than the issue's 1: parallel calls (two here) in half the tokens
    full, streamed = chat(live, messages=[{"role": "user", "content": "weather in Paris?"}], tools=[GET_WEATHER, ADD],
                          tool_choice="required", temperature=1.0, seed=2, max_tokens=200)
    (choice,) = full.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    assert choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), ISSUE_SCHEMAS[call.function.name])
    assert_same_as_streamed(full, streamed)


@pytest.mark.parametrize("tool_choice, names", [("required", {"get_weather", "get_time"}), (NAMED, {"get_time"})],
                         ids=["required", "named"])
def test_forced_choices_with_n_2_streamed_and_not(live, tool_choice, names):
    full, streamed = chat(live, messages=MSG, tools=TOOLS, tool_choice=tool_choice, parallel_tool_calls=False,
                          n=2, temperature=1.0, seed=7, max_tokens=60)
    assert len(full.choices) == 2
    for choice in full.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
        (call,) = choice.message.tool_calls
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    assert_same_as_streamed(full, streamed)


def test_a_forced_call_cut_by_max_tokens_ends_with_length(live):
    full, streamed = chat(live, messages=MSG, tools=TOOLS, tool_choice=NAMED, temperature=0, max_tokens=14)
    (choice,) = full.choices
    assert choice.finish_reason == "length"
    assert_same_as_streamed(full, streamed)  # the same cut call (or text), streamed or not
    if choice.message.tool_calls:  # cut inside the arguments: the call as far as it was written
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_time" and call.function.arguments.startswith("{")


def a_call_in_the_servers_format(live: LiveServer) -> dict:
    """A grammar that makes the model write a get_time call as the server's parser reads it, tags
    spelled as this vocabulary holds them: a stand-in for a model that chose to call."""
    model = live.state.model
    return {"grammar": model.tool_parser.grammar(TOOLS, NAMED, False, model.tool_tags.tokens)}


def test_auto_turns_a_call_into_tool_calls_and_text_into_content(live):
    if live.state.config.tool_call_parser is None:  # "auto" needs the flags: a 400 naming the field
        with pytest.raises(openai.BadRequestError, match="tool_choice"):
            client_for(live).chat.completions.create(model=MODEL, messages=MSG, tools=TOOLS, tool_choice="auto",
                                                     max_tokens=4)
        return
    full, streamed = chat(live, messages=MSG, tools=TOOLS, tool_choice="auto", temperature=1.0, seed=3,
                          max_tokens=60, structured_outputs=a_call_in_the_servers_format(live))
    (choice,) = full.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    ((name, arguments),) = calls_of(choice.message)
    assert name == "get_time"
    jsonschema.validate(json.loads(arguments), SCHEMAS["get_time"])
    assert_same_as_streamed(full, streamed)
    text, streamed = chat(live, messages=MSG, tools=TOOLS, tool_choice="auto", temperature=0, max_tokens=12,
                          structured_outputs={"choice": ["It is sunny."]})
    assert text.choices[0].message.content == "It is sunny." and not text.choices[0].message.tool_calls
    assert text.choices[0].finish_reason == "stop"
    assert_same_as_streamed(text, streamed)


def test_none_never_returns_tool_calls(live):
    full, streamed = chat(live, messages=MSG, tools=TOOLS, tool_choice="none", temperature=0, max_tokens=60,
                          structured_outputs=a_call_in_the_servers_format(live))
    (choice,) = full.choices
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    assert '"name": "get_time"' in choice.message.content  # the call is text, decoded as the tokenizer says
    assert_same_as_streamed(full, streamed)
