"""Every client error gets its OpenAI-shaped status (400/401/404/405/413/429), never a 500, and a
malformed body never reaches the engine."""

from __future__ import annotations

import asyncio

import httpx
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
    ("completions", {"prompt": "hi " * 300, "max_tokens": 16}, "max_tokens"),
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
    ("completions", {"prompt": "hi", "model": "gpt-4"}, "model"),
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
    ("chat/completions", {"messages": MSG, "max_tokens": 300}, "max_tokens"),
    ("chat/completions", {"messages": MSG, "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ("chat/completions", {"messages": MSG, "response_format": {"type": "json_object"}}, "response_format"),
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
