"""POST /tokenize and /detokenize in vLLM's shapes and GET /version on a real server with the real
Qwen tokenizer: the ids are transformers' own and the ones the generation endpoints count; bad
bodies get a 400 naming the field and never reach the engine; every endpoint is counted in /metrics."""

from __future__ import annotations

import importlib.metadata

import httpx
import pytest
from transformers import AutoTokenizer

from server_utils import MODEL, LiveServer, start_server
from test_server_errors import assert_openai_error, engine_counters

KEY = "sk-tokenize"
AUTH = {"Authorization": f"Bearer {KEY}"}
TEXT = "Tokenize me: naïve café, 東京, 🙂 and\ttabs."
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}]
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                        "required": ["city"]}}}


@pytest.fixture(scope="module")
def live(loaded_model) -> LiveServer:
    server = start_server(loaded_model, api_key=KEY)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def hf(loaded_model):
    """transformers' tokenizer of the served model, loaded on its own: the oracle."""
    return AutoTokenizer.from_pretrained(str(loaded_model[2]), local_files_only=True)


def post(live: LiveServer, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{live.url}{path}", json=body, headers=AUTH, timeout=60)


def test_a_text_tokenizes_as_transformers_does_and_as_completions_count_it(live, hf):
    r = post(live, "/tokenize", {"model": MODEL, "prompt": TEXT})
    assert r.status_code == 200, r.text
    body = r.json()
    want = hf.encode(TEXT)
    assert body == {"count": len(want), "max_model_len": 512, "tokens": want, "token_strs": None}
    strs = post(live, "/tokenize", {"prompt": TEXT, "return_token_strs": True}).json()["token_strs"]
    assert strs == hf.convert_ids_to_tokens(want)
    completion = post(live, "/v1/completions", {"model": MODEL, "prompt": TEXT, "max_tokens": 1}).json()
    assert completion["usage"]["prompt_tokens"] == body["count"]
    empty = post(live, "/tokenize", {"prompt": ""}).json()
    assert empty["count"] == 0 and empty["tokens"] == []


def test_a_chat_tokenizes_as_the_chat_endpoint_renders_it(live, hf):
    body = post(live, "/tokenize", {"model": MODEL, "messages": CHAT}).json()
    assert body["tokens"] == hf.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True,
                                                    return_dict=False)
    chat = post(live, "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 1}).json()
    assert chat["usage"]["prompt_tokens"] == body["count"]
    without = post(live, "/tokenize", {"messages": CHAT, "add_generation_prompt": False}).json()
    assert body["tokens"][:without["count"]] == without["tokens"] and without["count"] < body["count"]
    # an open assistant turn, continued: the rendering ends with its text, not with a turn's end
    opened = CHAT + [{"role": "assistant", "content": "The answer is"}]
    cont = post(live, "/tokenize", {"messages": opened, "add_generation_prompt": False,
                                    "continue_final_message": True}).json()
    assert hf.decode(cont["tokens"]).endswith("The answer is")
    tools = post(live, "/tokenize", {"messages": CHAT, "tools": [TOOL]}).json()
    assert "get_weather" in hf.decode(tools["tokens"]) and tools["count"] > body["count"]


def test_detokenize_gives_back_the_text_with_its_special_tokens(live, hf):
    ids = hf.encode(TEXT)
    assert post(live, "/detokenize", {"model": MODEL, "tokens": ids}).json() == {"prompt": TEXT}
    chat_ids = hf.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=False)
    text = post(live, "/detokenize", {"tokens": chat_ids}).json()["prompt"]
    assert text == hf.decode(chat_ids) and text.startswith("<|im_start|>system")
    assert post(live, "/detokenize", {"tokens": []}).json() == {"prompt": ""}


def test_version_names_the_installed_package(live):
    r = httpx.get(f"{live.url}/version")  # no key needed, as /health
    assert r.status_code == 200 and r.json() == {"version": importlib.metadata.version("jaxserve")}


VOCAB = 151936  # the default model's embedding rows
BAD = [
    ("/tokenize", {"prompt": "hi", "messages": CHAT}, "prompt"),
    ("/tokenize", {"model": MODEL}, "prompt"),
    ("/tokenize", {"prompt": ["a", "b"]}, "prompt"),
    ("/tokenize", {"prompt": "hi", "add_special_tokens": "yes"}, "add_special_tokens"),
    ("/tokenize", {"prompt": "hi", "return_token_strs": 1}, "return_token_strs"),
    ("/tokenize", {"messages": []}, "messages"),
    ("/tokenize", {"messages": [{"role": "robot", "content": "hi"}]}, "messages"),
    ("/tokenize", {"messages": CHAT, "continue_final_message": True}, "continue_final_message"),
    ("/tokenize", {"messages": CHAT, "chat_template_kwargs": {"messages": 1}}, "chat_template_kwargs"),
    ("/tokenize", {"messages": CHAT, "tools": [{"type": "function"}]}, "tools"),
    ("/detokenize", {}, "tokens"),
    ("/detokenize", {"tokens": "1 2 3"}, "tokens"),
    ("/detokenize", {"tokens": [1, -1]}, "tokens"),
    ("/detokenize", {"tokens": [1, VOCAB]}, "tokens"),
    ("/detokenize", {"tokens": [1, True]}, "tokens"),
]


@pytest.mark.parametrize("path,body,param", BAD)
def test_bad_bodies_get_400_naming_the_field_and_never_reach_the_engine(live, path, body, param):
    before = engine_counters(live)
    error = assert_openai_error(post(live, path, body), 400, param)
    assert error["type"] == "invalid_request_error"
    assert engine_counters(live) == before


def test_a_key_and_a_served_model_are_required(live):
    assert_openai_error(httpx.post(f"{live.url}/tokenize", json={"prompt": "hi"}), 401)
    assert_openai_error(httpx.post(f"{live.url}/detokenize", json={"tokens": [1]}), 401)
    assert_openai_error(post(live, "/tokenize", {"model": "gpt-4", "prompt": "hi"}), 404, "model")
    assert_openai_error(post(live, "/detokenize", {"model": "gpt-4", "tokens": [1]}), 404, "model")
    assert_openai_error(httpx.post(f"{live.url}/tokenize", content=b"{", headers={**AUTH, "content-type":
                                                                                   "application/json"}), 400)


def test_requests_are_counted_by_endpoint_and_status(live):
    before = live.metrics()
    post(live, "/tokenize", {"prompt": "hi"})
    post(live, "/tokenize", {"prompt": 3})
    post(live, "/detokenize", {"tokens": [1]})
    httpx.get(f"{live.url}/no/such/path/{id(live)}")  # any unknown path: one "other" series
    after = live.metrics()

    def delta(endpoint: str, status: int) -> float:
        name = f"jaxserve:http_requests_total{{endpoint={endpoint},status={status}}}"
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert (delta("/tokenize", 200), delta("/tokenize", 400), delta("/detokenize", 200)) == (1, 1, 1)
    assert delta("other", 404) == 1
    assert not any(f"{id(live)}" in name for name in after)
