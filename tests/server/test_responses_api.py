"""Issue 45 item 1: POST /v1/responses (OpenAI's Responses API) through the official openai client:
text and item-list input, instructions, max_output_tokens, streamed semantic events, forced tool
calls and a function_call_output round trip, text.format, reasoning items, the response store
(--enable-response-store) and bad input.

Real uvicorn servers around the session's engine core; a module's servers differ in their flags
and run one at a time (`servers.get(...)` stops the running one when the flags change), so tests
are grouped by server. Greedy outputs are compared with /v1/chat/completions on the same
messages: the Responses route renders its prompt through the chat path, token for token."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import (ResponseCompletedEvent, ResponseFunctionCallArgumentsDeltaEvent,
                                    ResponseIncompleteEvent, ResponseOutputItemAddedEvent,
                                    ResponseReasoningTextDeltaEvent, ResponseTextDeltaEvent)

from server_utils import MODEL, LiveServer, client_for, start_server
from structured_cases import PERSON

AUTO_TOOLS = dict(enable_auto_tool_choice=True, tool_call_parser="hermes")
STORE = dict(AUTO_TOOLS, enable_response_store=True)
REASONING = dict(reasoning_parser="qwen3")
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                          "properties": {"city": {"type": "string", "maxLength": 8},
                                         "unit": {"enum": ["celsius", "fahrenheit"]}}}, "strict": True}
CHAT_WEATHER = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}
HI = [{"role": "user", "content": "Hi"}]


class Servers:
    """One live server at a time, restarted when a test asks for other flags."""

    def __init__(self, loaded_model: Any) -> None:
        self.loaded_model = loaded_model
        self.live: LiveServer | None = None
        self.config: dict | None = None

    def get(self, **config: Any) -> LiveServer:
        if self.live is None or self.config != config:
            self.stop()
            self.live, self.config = start_server(self.loaded_model, **config), config
        return self.live

    def stop(self) -> None:
        if self.live is not None:
            live, self.live = self.live, None
            live.stop()


@pytest.fixture(scope="module")
def servers(loaded_model):
    pool = Servers(loaded_model)
    yield pool
    pool.stop()


@pytest.fixture
def tools_server(servers) -> LiveServer:
    return servers.get(**AUTO_TOOLS)


def prompt_len(loaded_model, messages: list[dict], **kwargs: Any) -> int:
    return len(loaded_model[1].apply_chat_template(messages, add_generation_prompt=True, **kwargs))


def chat_text(live: LiveServer, messages: list[dict], max_tokens: int, **body: Any) -> str:
    out = client_for(live).chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens,
                                                   temperature=0, **body)
    return out.choices[0].message.content or ""


def stream_events(live: LiveServer, **body: Any) -> list[Any]:
    """The typed events of a streamed response, checked for numbering and framing."""
    events = list(client_for(live).responses.create(model=MODEL, stream=True, **body))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return events


def raw_frames(live: LiveServer, body: dict) -> list[tuple[str, dict]]:
    """(event line, data object) of each SSE frame of a streamed response."""
    frames = []
    with httpx.stream("POST", f"{live.url}/v1/responses", json={"model": MODEL, **body, "stream": True},
                      timeout=300) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        text = r.read().decode()
    for block in text.strip().split("\n\n"):
        event_line, data_line = block.split("\n")
        assert event_line.startswith("event: ") and data_line.startswith("data: ")
        frames.append((event_line[len("event: "):], json.loads(data_line[len("data: "):])))
    return frames


def shape(events: list[Any]) -> list[str]:
    """Event types with runs of deltas collapsed to one."""
    out: list[str] = []
    for e in events:
        if not (e.type.endswith(".delta") and out and out[-1] == e.type):
            out.append(e.type)
    return out


# ---------------------------------------------------------------- text


def test_plain_text_response(tools_server, loaded_model):
    r = client_for(tools_server).responses.create(model=MODEL, input="Hi", max_output_tokens=8, temperature=0)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    assert item.content[0].type == "output_text" and r.output_text == item.content[0].text != ""
    assert r.output_text == chat_text(tools_server, HI, 8)
    assert r.usage.input_tokens == prompt_len(loaded_model, HI)
    assert 0 < r.usage.output_tokens <= 8
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    assert r.store is False and r.tools == [] and r.tool_choice == "auto" and r.temperature == 0


def test_string_and_item_list_input_give_the_same_prompt(tools_server, loaded_model):
    client = client_for(tools_server)
    inputs = ["Hi", HI, [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "H"},
                                                                          {"type": "input_text", "text": "i"}]}]]
    answers = [client.responses.create(model=MODEL, input=i, max_output_tokens=6, temperature=0) for i in inputs]
    assert len({(a.output_text, a.usage.input_tokens) for a in answers}) == 1
    assert answers[0].usage.input_tokens == prompt_len(loaded_model, HI)


def test_instructions_become_the_system_message(tools_server, loaded_model):
    r = client_for(tools_server).responses.create(model=MODEL, input="Hi", instructions="Be brief.",
                                                  max_output_tokens=6, temperature=0, metadata={"k": "v"}, user="u1")
    messages = [{"role": "system", "content": "Be brief."}, *HI]
    assert r.instructions == "Be brief." and r.metadata == {"k": "v"} and r.user == "u1"
    assert r.usage.input_tokens == prompt_len(loaded_model, messages)
    assert r.output_text == chat_text(tools_server, messages, 6)


def test_max_output_tokens_makes_the_response_incomplete(tools_server):
    r = client_for(tools_server).responses.create(model=MODEL, input="Hi", max_output_tokens=3, temperature=0)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3 and r.max_output_tokens == 3
    assert r.output[0].status == "incomplete"


def test_streamed_text_equals_the_whole_response_in_openais_event_order(tools_server):
    body = dict(input="Hi", max_output_tokens=10, temperature=0)
    whole = client_for(tools_server).responses.create(model=MODEL, **body)
    events = stream_events(tools_server, **body)
    assert shape(events) == ["response.created", "response.in_progress", "response.output_item.added",
                             "response.content_part.added", "response.output_text.delta",
                             "response.output_text.done", "response.content_part.done",
                             "response.output_item.done", "response.incomplete"]
    deltas = [e for e in events if isinstance(e, ResponseTextDeltaEvent)]
    assert "".join(d.delta for d in deltas) == whole.output_text
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    added = next(e for e in events if isinstance(e, ResponseOutputItemAddedEvent))
    assert {d.item_id for d in deltas} == {added.item.id} and {d.output_index for d in deltas} == {0}
    done = next(e for e in events if e.type == "response.output_text.done")
    assert done.text == whole.output_text
    final = events[-1]
    assert isinstance(final, ResponseIncompleteEvent)
    assert final.response.output_text == whole.output_text and final.response.usage == whole.usage
    assert final.response.id == events[0].response.id
    # the wire format: an `event:` line naming the data's type
    frames = raw_frames(tools_server, body)
    assert all(name == data["type"] for name, data in frames)
    assert [data["sequence_number"] for _, data in frames] == list(range(len(frames)))


def test_the_sdk_stream_helper_accumulates_the_events(tools_server):
    """`responses.stream` rebuilds the response from the events (it needs response.completed: a
    constrained output that ends)."""
    fmt = {"type": "json_schema", "name": "person", "schema": PERSON}
    body = dict(input="A person", max_output_tokens=60, temperature=0, text={"format": fmt})
    whole = client_for(tools_server).responses.create(model=MODEL, **body)
    with client_for(tools_server).responses.stream(model=MODEL, **body) as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert text == final.output_text == whole.output_text and whole.status == "completed"
    jsonschema.validate(json.loads(text), PERSON)


def test_text_format_json_schema_output_parses(tools_server):
    fmt = {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}
    r = client_for(tools_server).responses.create(model=MODEL, input="A person", max_output_tokens=60,
                                                  temperature=1.0, text={"format": fmt})
    assert r.status == "completed", r
    jsonschema.validate(json.loads(r.output_text), PERSON)
    assert r.text.format.type == "json_schema" and r.text.format.name == "person"
    obj = client_for(tools_server).responses.create(model=MODEL, input="An object", max_output_tokens=8,
                                                    temperature=0, text={"format": {"type": "json_object"}})
    plain = client_for(tools_server).responses.create(model=MODEL, input="An object", max_output_tokens=8,
                                                      temperature=0)
    # random weights rarely close an object in 8 tokens; the grammar makes it start as one
    assert obj.output_text.startswith("{") and obj.output_text != plain.output_text


# ---------------------------------------------------------------- tools


def function_calls(output: list[Any]) -> list[tuple[str, str]]:
    return [(item.name, item.arguments) for item in output if item.type == "function_call"]


@pytest.mark.parametrize("choice", [{"type": "function", "name": "get_weather"}, "required"])
def test_forced_tool_call_streamed_equals_whole(tools_server, choice):
    body = dict(input="Weather in Paris?", tools=[WEATHER], tool_choice=choice, temperature=0,
                max_output_tokens=120, parallel_tool_calls=False)
    whole = client_for(tools_server).responses.create(model=MODEL, **body)
    assert whole.status == "completed", whole
    (call,) = whole.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    assert call.id.startswith("fc_") and call.status == "completed" and whole.output_text == ""
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    assert whole.tools[0].name == "get_weather" and whole.parallel_tool_calls is False

    events = stream_events(tools_server, **body)
    assert shape(events) == ["response.created", "response.in_progress", "response.output_item.added",
                             "response.function_call_arguments.delta", "response.function_call_arguments.done",
                             "response.output_item.done", "response.completed"]
    added = events[2].item
    assert added.type == "function_call" and added.name == "get_weather" and added.arguments == ""
    streamed = "".join(e.delta for e in events if isinstance(e, ResponseFunctionCallArgumentsDeltaEvent))
    assert [("get_weather", streamed)] == function_calls(whole.output)
    assert events[-3].arguments == streamed and events[-2].item.arguments == streamed
    assert isinstance(events[-1], ResponseCompletedEvent)
    assert function_calls(events[-1].response.output) == function_calls(whole.output)


def test_function_call_output_round_trip(tools_server, loaded_model):
    client = client_for(tools_server)
    first = client.responses.create(model=MODEL, input="Weather in Paris?", tools=[WEATHER], temperature=0,
                                    tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=120)
    (call,) = first.output
    result = '{"temperature": 21}'
    items = [{"role": "user", "content": "Weather in Paris?"}, call.model_dump(exclude_none=True),
             {"type": "function_call_output", "call_id": call.call_id, "output": result}]
    second = client.responses.create(model=MODEL, input=items, tools=[WEATHER], tool_choice="none",
                                     temperature=0, max_output_tokens=8)
    (message,) = second.output
    assert message.type == "message" and second.output_text
    chat_messages = [{"role": "user", "content": "Weather in Paris?"},
                     {"role": "assistant", "content": "", "tool_calls": [
                         {"id": call.call_id, "type": "function",
                          "function": {"name": call.name, "arguments": call.arguments}}]},
                     {"role": "tool", "tool_call_id": call.call_id, "content": result}]
    # the call and its output reached the prompt exactly as the chat route renders them
    assert second.usage.input_tokens == prompt_len(loaded_model, chat_messages, tools=[CHAT_WEATHER])
    assert second.output_text == chat_text(tools_server, chat_messages, 8, tools=[CHAT_WEATHER], tool_choice="none")


# ---------------------------------------------------------------- bad input; the store off


BAD_BODIES = [
    ({"input": [{"type": "computer_call_output", "call_id": "x"}]}, "input", "not a supported input item"),
    ({"input": ""}, "input", "must not be empty"),
    ({"input": []}, "input", "non-empty"),
    ({}, "input", "non-empty"),
    ({"input": "Hi", "max_output_tokens": -1}, "max_output_tokens", "must be in"),
    ({"input": "Hi", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice",
     "not in tools"),
    ({"input": "Hi", "tool_choice": {"type": "function", "name": "get_weather"}}, "tool_choice", "no 'tools'"),
    ({"input": "Hi", "tools": [{"type": "web_search"}]}, "tools", "function tools only"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, "input",
     "text only"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input", "role"),
    ({"input": "Hi", "text": {"format": {"type": "json_schema", "name": "p"}}}, "text.format", "schema"),
    ({"input": "Hi", "store": True}, "store", "--enable-response-store"),
    ({"input": "Hi", "previous_response_id": "resp_x"}, "previous_response_id", "--enable-response-store"),
    ({"input": "Hi", "background": True}, "background", "not supported"),
    ({"input": "x " * 600}, "input", "max_model_len"),
]


@pytest.mark.parametrize("body,param,words", BAD_BODIES, ids=[f"bad{i}" for i in range(len(BAD_BODIES))])
def test_bad_input_is_a_400_naming_the_field(tools_server, body, param, words):
    with pytest.raises(openai.BadRequestError) as e:
        client_for(tools_server).responses.create(model=MODEL, **body)
    error = e.value.body
    assert e.value.status_code == 400 and error["param"] == param and words in error["message"], error
    assert error["type"] == "invalid_request_error"


def test_the_server_keeps_serving_after_bad_input(tools_server):
    before = tools_server.metrics()
    for body, _, _ in BAD_BODIES[:3]:
        r = httpx.post(f"{tools_server.url}/v1/responses", json={"model": MODEL, **body}, timeout=60)
        assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = client_for(tools_server).responses.create(model=MODEL, input="Hi", max_output_tokens=4, temperature=0)
    assert r.usage.output_tokens == 4
    after = tools_server.wait_idle()
    key = "jaxserve:http_requests_total{endpoint=/v1/responses,status=%d}"
    assert after[key % 400] - before.get(key % 400, 0) == 3 and after[key % 200] - before.get(key % 200, 0) == 1


def test_without_the_store_responses_are_not_kept(tools_server):
    r = client_for(tools_server).responses.create(model=MODEL, input="Hi", max_output_tokens=2, store=False)
    assert r.store is False
    got = httpx.get(f"{tools_server.url}/v1/responses/{r.id}")
    assert got.status_code == 400 and "--enable-response-store" in got.json()["error"]["message"]


# ---------------------------------------------------------------- the store on


def test_stored_responses_are_retrieved_and_continued(servers, loaded_model):
    live = servers.get(**STORE)
    client = client_for(live)
    first = client.responses.create(model=MODEL, input="Hi", max_output_tokens=5, temperature=0)
    assert first.store is True
    got = client.responses.retrieve(first.id)
    assert got.id == first.id and got.output_text == first.output_text and got.usage == first.usage
    second = client.responses.create(model=MODEL, input="And then?", previous_response_id=first.id,
                                     instructions="Be brief.", max_output_tokens=5, temperature=0)
    assert second.previous_response_id == first.id
    history = [*HI, {"role": "assistant", "content": first.output_text}, {"role": "user", "content": "And then?"}]
    messages = [{"role": "system", "content": "Be brief."}, *history]
    assert second.usage.input_tokens == prompt_len(loaded_model, messages)
    assert second.output_text == chat_text(live, messages, 5)
    # a chain: the third turn sees both earlier ones (but not the second's instructions)
    third = client.responses.create(model=MODEL, input="Ok.", previous_response_id=second.id, max_output_tokens=3,
                                    temperature=0)
    turns = [*history, {"role": "assistant", "content": second.output_text}, {"role": "user", "content": "Ok."}]
    assert third.usage.input_tokens == prompt_len(loaded_model, turns)
    # streamed responses are stored too; store=false ones are not
    events = stream_events(live, input="Hi", max_output_tokens=4, temperature=0)
    assert client.responses.retrieve(events[-1].response.id).output_text == events[-1].response.output_text
    unstored = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="x", previous_response_id=first.id)
    assert e.value.body["param"] == "previous_response_id" and e.value.body["code"] == "previous_response_not_found"
    metrics = live.wait_idle()
    assert metrics["jaxserve:http_requests_total{endpoint=/v1/responses/{response_id},status=200}"] >= 2


def test_the_store_is_bounded_in_count_and_bytes():
    from jaxserve.server.responses_store import ResponseStore

    store = ResponseStore(max_responses=2, max_bytes=400)
    for i in range(3):
        assert store.put({"id": f"r{i}", "output": []}, [])
    assert store.get("r0") is None and store.get("r1") and store.get("r2") and len(store) == 2
    assert store.put({"id": "big", "output": ["x" * 360]}, [])  # 391 bytes: evicts until it fits
    assert len(store) == 1 and store.bytes <= 400
    assert not store.put({"id": "huge", "output": ["x" * 500]}, [])  # never fits: not kept
    assert store.get("big") is not None


# ---------------------------------------------------------------- reasoning


def test_reasoning_becomes_a_reasoning_item(servers, loaded_model):
    """Biased toward `<think>`, the model writes nothing but reasoning: a reasoning item comes first,
    streamed as reasoning_text deltas that reassemble to it."""
    live = servers.get(**REASONING)
    think = loaded_model[1].hf.convert_tokens_to_ids("<think>")
    body = dict(input="Hi", max_output_tokens=6, temperature=0, extra_body={"logit_bias": {str(think): 100}})
    whole = client_for(live).responses.create(model=MODEL, **body)
    (item,) = whole.output
    assert item.type == "reasoning" and item.id.startswith("rs_") and item.status == "incomplete"
    assert item.content[0].type == "reasoning_text" and item.content[0].text.startswith("<think>")
    assert whole.output_text == "" and whole.usage.output_tokens_details.reasoning_tokens == 6
    events = stream_events(live, **body)
    assert shape(events) == ["response.created", "response.in_progress", "response.output_item.added",
                             "response.content_part.added", "response.reasoning_text.delta",
                             "response.reasoning_text.done", "response.content_part.done",
                             "response.output_item.done", "response.incomplete"]
    text = "".join(e.delta for e in events if isinstance(e, ResponseReasoningTextDeltaEvent))
    assert text == item.content[0].text == events[-1].response.output[0].content[0].text


# ---------------------------------------------------------------- a request past its deadline


def test_a_timed_out_stream_ends_with_an_error_event(servers):
    live = servers.get(request_timeout=0.001)
    with pytest.raises(openai.APIStatusError) as e:
        client_for(live).responses.create(model=MODEL, input="Hi", max_output_tokens=50)
    assert e.value.status_code == 504 and e.value.body["code"] == "request_timeout"
    events = stream_events(live, input="Hi", max_output_tokens=50)
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1].type == "error" and events[-1].code == "request_timeout"
    live.wait_idle()  # the engine requests were aborted
