"""Every client error gets its OpenAI-shaped status (400/401/404/405/413/429), never a 500, and a
malformed body never reaches the engine; a server fault is a 500 that says so."""

from __future__ import annotations

import asyncio
import logging

import httpx
import openai
import pytest

from server_utils import MODEL, LiveServer, start_server

KEY = "sk-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
BODY_LIMIT = 64 * 1024
MAX_WAITING = 4
MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def live(loaded_model) -> LiveServer:
    server = start_server(loaded_model, api_key=KEY, max_request_bytes=BODY_LIMIT,
                          max_waiting_requests=MAX_WAITING)
    yield server
    server.stop()


def assert_openai_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    assert r.headers["content-type"] == "application/json"
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    if param is not None:
        assert body["error"]["param"] == param, body
    return body["error"]


# (endpoint, JSON body, the param the error must name, or None when no single field is to blame)
INVALID_BODIES = [
    ("completions", {}, "prompt"),
    ("completions", {"prompt": ""}, "prompt"),
    ("completions", {"prompt": []}, "prompt"),
    ("completions", {"prompt": None}, "prompt"),
    ("completions", {"prompt": 42}, "prompt"),
    ("completions", {"prompt": [1, -2]}, "prompt"),
    ("completions", {"prompt": [10**9]}, "prompt"),
    ("completions", {"prompt": [[1, 2], []]}, "prompt"),
    ("completions", {"prompt": [True, False]}, "prompt"),
    # Too long for max_model_len (512): the prompt alone fills it -> the prompt's fault; the prompt
    # fits but the max_tokens the client sent does not -> max_tokens' fault.
    ("completions", {"prompt": "hi " * 600}, "prompt"),
    ("completions", {"prompt": "hi " * 600, "max_tokens": 16}, "prompt"),
    ("completions", {"prompt": "hi " * 600, "max_tokens": None}, "prompt"),
    ("completions", {"prompt": ["hi", "hi " * 600]}, "prompt"),
    ("completions", {"prompt": "hi " * 505}, "prompt"),  # fits alone, not with the default max_tokens 16
    ("completions", {"prompt": "hi " * 400, "max_tokens": 200}, "max_tokens"),
    ("completions", {"prompt": "hi", "max_tokens": -1}, "max_tokens"),
    ("completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("completions", {"prompt": "hi", "max_tokens": "10"}, "max_tokens"),
    ("completions", {"prompt": "hi", "max_tokens": 1.5}, "max_tokens"),
    ("completions", {"prompt": "hi", "max_tokens": 10**30}, "max_tokens"),
    ("completions", {"prompt": "hi", "temperature": -0.5}, "temperature"),
    ("completions", {"prompt": "hi", "temperature": "hot"}, "temperature"),
    ("completions", {"prompt": "hi", "top_p": 0}, "top_p"),
    ("completions", {"prompt": "hi", "top_p": 1.5}, "top_p"),
    ("completions", {"prompt": "hi", "top_k": -5}, "top_k"),
    ("completions", {"prompt": "hi", "min_p": 2}, "min_p"),
    ("completions", {"prompt": "hi", "repetition_penalty": 0}, "repetition_penalty"),
    ("completions", {"prompt": "hi", "presence_penalty": 5}, "presence_penalty"),
    ("completions", {"prompt": "hi", "frequency_penalty": [1]}, "frequency_penalty"),
    ("completions", {"prompt": "hi", "n": 0}, "n"),
    ("completions", {"prompt": "hi", "n": 10**6}, "n"),
    ("completions", {"prompt": ["a", "b", "c"], "n": 2}, "n"),  # 6 sequences > max_waiting_requests (4)
    ("completions", {"prompt": "hi", "stop": 5}, "stop"),
    ("completions", {"prompt": "hi", "stop": [""]}, "stop"),
    ("completions", {"prompt": "hi", "stop": ["x"] * 17}, "stop"),
    ("completions", {"prompt": "hi", "stop_token_ids": [1.5]}, "stop_token_ids"),
    ("completions", {"prompt": "hi", "logprobs": 21}, "logprobs"),
    ("completions", {"prompt": "hi", "logprobs": True}, "logprobs"),
    ("completions", {"prompt": "hi", "logit_bias": {"abc": 1}}, "logit_bias"),
    ("completions", {"prompt": "hi", "logit_bias": {"5": 1000}}, "logit_bias"),
    ("completions", {"prompt": "hi", "logit_bias": [1, 2]}, "logit_bias"),
    ("completions", {"prompt": "hi", "seed": 2**70}, "seed"),
    ("completions", {"prompt": "hi", "min_tokens": 50, "max_tokens": 10}, "min_tokens"),
    ("completions", {"prompt": "hi", "model": 7}, "model"),
    ("completions", {"prompt": "hi", "stream": "yes"}, "stream"),
    ("completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
    ("completions", {"prompt": "hi", "stream": True, "stream_options": {"include_usage": 1}}, "include_usage"),
    ("completions", {"prompt": "hi", "ignore_eos": "true"}, "ignore_eos"),
    ("completions", {"prompt": "hi", "echo": True}, "echo"),
    ("completions", {"prompt": "hi", "best_of": 3}, "best_of"),
    ("completions", {"prompt": "hi", "cache_salt": ""}, "cache_salt"),
    ("completions", {"prompt": "hi", "priority": "high"}, "priority"),
    ("completions", {"prompt": "hi", "user": 5}, "user"),
    ("chat/completions", {}, "messages"),
    ("chat/completions", {"messages": []}, "messages"),
    ("chat/completions", {"messages": "hello"}, "messages"),
    ("chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ("chat/completions", {"messages": [{"role": "user"}]}, "messages"),
    ("chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages"),
    ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
    ("chat/completions", {"messages": ["hi"]}, "messages"),
    ("chat/completions", {"messages": MSG, "top_logprobs": 2}, "top_logprobs"),
    ("chat/completions", {"messages": MSG, "logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    ("chat/completions", {"messages": MSG, "logprobs": 1}, "logprobs"),
    ("chat/completions", {"messages": MSG, "max_completion_tokens": 0}, "max_completion_tokens"),
    ("chat/completions", {"messages": MSG, "max_tokens": 600}, "max_tokens"),
    ("chat/completions", {"messages": MSG, "max_completion_tokens": 600}, "max_completion_tokens"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi " * 600}]}, "messages"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi " * 600}], "max_tokens": 8}, "messages"),
    ("chat/completions", {"messages": MSG, "tools": [{"type": "function", "function": {"name": 5}}]}, "tools"),
    ("chat/completions", {"messages": MSG, "response_format": {"type": "xml"}}, "response_format"),
    ("chat/completions", {"messages": MSG, "chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
]

# (raw body, content type) that never parse into a request
INVALID_RAW = [
    (b'{"prompt": "hi",', "application/json"),                      # truncated JSON
    (b"", "application/json"),                                      # empty body
    (b"\xff\xfe{\"prompt\": \"hi\"}", "application/json"),          # invalid UTF-8
    (b'{"prompt": "\xc3\x28"}', "application/json"),                # invalid UTF-8 inside a string
    (b'{"prompt": "\\ud800"}', "application/json"),                 # lone surrogate escape
    (b"[1, 2, 3]", "application/json"),                             # not an object
    (b'"just a string"', "application/json"),
    (b'{"prompt": "hi", "temperature": NaN}', "application/json"),
    (b'{"prompt": "hi", "temperature": Infinity}', "application/json"),
    (b'{"prompt": "hi", "max_tokens": 1' + b"0" * 5000 + b"}", "application/json"),  # 5001-digit integer
    (b"[" * 20000 + b"]" * 20000, "application/json"),              # nesting deeper than the recursion limit
    (b'{"prompt": "hi"}', "text/plain"),                            # wrong content type
    (b'{"prompt": "hi"}', ""),                                      # no content type
]


def engine_counters(live: LiveServer) -> tuple:
    m = live.metrics()
    return (m["jaxserve:prompt_tokens_total"], m["jaxserve:prefix_cache_queries_total"],
            m["jaxserve:num_requests_waiting"], m["jaxserve:num_requests_running"])


@pytest.mark.parametrize("endpoint,body,param", INVALID_BODIES)
def test_invalid_fields_get_400_naming_the_field_and_never_reach_the_engine(live, endpoint, body, param):
    before = engine_counters(live)
    r = httpx.post(f"{live.url}/v1/{endpoint}", json=body, headers=AUTH, timeout=60)
    error = assert_openai_error(r, 400, param)
    assert error["type"] == "invalid_request_error"
    assert engine_counters(live) == before


@pytest.mark.parametrize("raw,content_type", INVALID_RAW)
def test_malformed_bodies_get_400_and_never_reach_the_engine(live, raw, content_type):
    before = engine_counters(live)
    headers = {**AUTH, "Content-Type": content_type} if content_type else AUTH
    r = httpx.post(f"{live.url}/v1/completions", content=raw, headers=headers, timeout=60)
    assert_openai_error(r, 400)
    assert engine_counters(live) == before


def test_api_key_is_required_on_v1_routes_only(live):
    ok = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    assert_openai_error(httpx.post(f"{live.url}/v1/completions", json=ok), 401)
    assert_openai_error(httpx.post(f"{live.url}/v1/completions", json=ok,
                                   headers={"Authorization": "Bearer wrong"}), 401)
    assert_openai_error(httpx.post(f"{live.url}/v1/completions", json=ok,
                                   headers={"Authorization": f"Basic {KEY}"}), 401)
    assert_openai_error(httpx.get(f"{live.url}/v1/models"), 401)
    # Auth is checked before the body is even read: garbage without a key is still a 401.
    assert_openai_error(httpx.post(f"{live.url}/v1/chat/completions", content=b"\xff"), 401)
    assert httpx.get(f"{live.url}/health").status_code == 200
    assert httpx.get(f"{live.url}/metrics").status_code == 200
    assert httpx.get(f"{live.url}/v1/models", headers=AUTH).status_code == 200
    r = httpx.post(f"{live.url}/v1/completions", json=ok, headers=AUTH, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1


def test_oversized_body_gets_413_with_or_without_content_length(live):
    big = b'{"prompt": "' + b"a" * (BODY_LIMIT + 10) + b'"}'
    headers = {**AUTH, "Content-Type": "application/json"}
    assert_openai_error(httpx.post(f"{live.url}/v1/completions", content=big, headers=headers, timeout=60), 413)

    def chunks():  # no Content-Length: the server must count while reading
        for i in range(0, len(big), 8192):
            yield big[i:i + 8192]

    assert_openai_error(httpx.post(f"{live.url}/v1/completions", content=chunks(), headers=headers, timeout=60), 413)


def test_unknown_route_and_wrong_method_get_openai_shaped_errors(live):
    assert_openai_error(httpx.get(f"{live.url}/v1/nothing", headers=AUTH), 404)
    assert_openai_error(httpx.get(f"{live.url}/v1/completions", headers=AUTH), 405)


def test_full_waiting_queue_gets_429_and_the_engine_recovers(live):
    """Many long requests at once: the running batch fills (16 sequences), then the waiting queue
    (4); later requests are refused with 429 instead of queueing without bound."""
    body = {"model": MODEL, "prompt": "Tell me a long story", "max_tokens": 200, "temperature": 0,
            "ignore_eos": True, "stream": True}

    async def run() -> list[int]:
        async with httpx.AsyncClient(base_url=live.url, headers=AUTH, timeout=120) as client:
            statuses: list[int] = []
            ready = asyncio.Event()

            async def one() -> None:
                async with client.stream("POST", "/v1/completions", json=body) as r:
                    statuses.append(r.status_code)
                    if r.status_code == 429:
                        assert_openai_error(httpx.Response(429, headers=r.headers, content=await r.aread()), 429)
                    if len(statuses) == 40:
                        ready.set()
                    await ready.wait()  # hold accepted streams open until every response has started
                # leaving the block closes the connection: the accepted requests are aborted

            await asyncio.gather(*(one() for _ in range(40)))
            return statuses

    statuses = asyncio.run(run())
    assert set(statuses) <= {200, 429}
    assert statuses.count(429) >= 1 and statuses.count(200) >= MAX_WAITING
    m = live.wait_idle(timeout=60)
    assert m["jaxserve:kv_cache_usage_perc"] == 0
    r = httpx.post(f"{live.url}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
                   headers=AUTH, timeout=60)
    assert r.status_code == 200


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_wrong_model_is_404_model_not_found_for_the_openai_client(live, endpoint):
    client = openai.OpenAI(base_url=f"{live.url}/v1", api_key=KEY, max_retries=0)
    before = engine_counters(live)
    with pytest.raises(openai.NotFoundError) as exc:
        if endpoint == "chat":
            client.chat.completions.create(model="gpt-4o", messages=MSG, max_tokens=1)
        else:
            client.completions.create(model="gpt-4o", prompt="hi", max_tokens=1)
    assert exc.value.status_code == 404 and exc.value.code == "model_not_found"
    assert "gpt-4o" in exc.value.message and MODEL in exc.value.message  # names both
    assert engine_counters(live) == before
    r = httpx.post(f"{live.url}/v1/completions", json={"model": "gpt-4o", "prompt": "hi"}, headers=AUTH)
    error = assert_openai_error(r, 404, "model")
    assert error["code"] == "model_not_found"


def test_unknown_fields_are_logged_once_by_name_and_the_request_is_served(live, caplog):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1, "frobnicate": True, "reasoning_effort": "low"}
    with caplog.at_level(logging.WARNING, logger="jaxserve.server"):
        r = httpx.post(f"{live.url}/v1/completions", json=body, headers=AUTH, timeout=60)
        chat = httpx.post(f"{live.url}/v1/chat/completions", json={"model": MODEL, "messages": MSG, "max_tokens": 1},
                          headers=AUTH, timeout=60)
    assert r.status_code == 200 and chat.status_code == 200
    ignored = [rec.getMessage() for rec in caplog.records if "ignored" in rec.getMessage()]
    assert ignored == ["The following fields were present in the request but ignored: "
                       "{'frobnicate', 'reasoning_effort'}"]


def test_chat_template_server_fault_is_a_500_that_says_so_not_a_400(live, loaded_model, monkeypatch, caplog):
    """transformers raises ImportError from apply_chat_template when jinja2 is missing: the server's
    fault, so not a 400 blaming 'messages'."""
    def no_jinja(*args, **kwargs):
        raise ImportError("apply_chat_template requires jinja2 to be installed.")

    # On the instance's __dict__, so that undoing it leaves the shared tokenizer exactly as it was.
    monkeypatch.setitem(vars(loaded_model[1].hf), "apply_chat_template", no_jinja)
    before = engine_counters(live)
    with caplog.at_level(logging.ERROR, logger="jaxserve.server"):
        r = httpx.post(f"{live.url}/v1/chat/completions", json={"model": MODEL, "messages": MSG}, headers=AUTH)
    assert r.status_code == 500, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] is None
    assert error["code"] == "chat_template_unavailable" and "jinja2" in error["message"]
    assert "server" in error["message"]
    assert engine_counters(live) == before
    assert any(rec.exc_info and "jinja2" in rec.getMessage() for rec in caplog.records)  # logged with its cause


def test_an_over_long_prompt_is_refused_with_one_log_line_of_ours(live, loaded_model, monkeypatch, caplog):
    """One line naming the lengths (the access line says only 400), and not transformers' warning
    about its tokenizer_config model_max_length, which a prompt this long passes too."""
    hf = loaded_model[1].hf
    monkeypatch.setattr(hf, "deprecation_warnings", {})  # transformers warns once per tokenizer
    heard: list[str] = []
    transformers_log = logging.getLogger("transformers")  # does not propagate to caplog's root handler
    monkeypatch.setattr(transformers_log, "handlers", [*transformers_log.handlers, logging.Handler()])
    monkeypatch.setattr(transformers_log.handlers[-1], "emit", lambda record: heard.append(record.getMessage()))
    text = "hi " * (hf.model_max_length + 100)
    with caplog.at_level(logging.INFO, logger="jaxserve"):
        r = httpx.post(f"{live.url}/v1/completions", json={"model": MODEL, "prompt": text}, headers=AUTH,
                       timeout=60)
    assert_openai_error(r, 400, "prompt")
    tokens = int(r.json()["error"]["message"].split(" has ")[1].split()[0])
    ours = [rec for rec in caplog.records if rec.name.startswith("jaxserve")]
    assert [rec.getMessage() for rec in ours] == [f"refused a request: prompt has {tokens} tokens, max_model_len "
                                                  f"is {live.state.core.engine_cfg.max_model_len}"]
    assert heard == []
