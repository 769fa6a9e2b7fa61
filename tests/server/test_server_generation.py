"""The OpenAI routes end to end on a real server: streamed == non-streamed, chunk shapes, usage,
n > 1, list prompts, logprobs, stop strings, no buffering, disconnects, 100 concurrent streams."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from server_utils import MODEL, LiveServer, client_for, read_sse, start_server

PROMPT = "The quick brown fox"
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def live(loaded_model) -> LiveServer:
    server = start_server(loaded_model)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(live: LiveServer) -> openai.OpenAI:
    return client_for(live)


@pytest.fixture(scope="module")
def tokenizer(loaded_model):
    return loaded_model[1]


def stream_events(live: LiveServer, path: str, body: dict) -> list:
    with httpx.stream("POST", f"{live.url}{path}", json={**body, "stream": True}, timeout=300) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        events = read_sse(r)
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    return events[:-1]


def greedy_completion(client: openai.OpenAI, prompt, max_tokens: int) -> str:
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                    extra_body={"ignore_eos": True})
    return out.choices[0].text


def test_completion_stream_equals_non_stream_and_chunks_have_openai_shape(live, client, tokenizer):
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert full.object == "text_completion" and full.model == MODEL and full.id.startswith("cmpl-")
    (choice,) = full.choices
    assert choice.index == 0 and choice.finish_reason == "length" and choice.logprobs is None
    n_prompt = len(tokenizer.encode(PROMPT))
    assert (full.usage.prompt_tokens, full.usage.completion_tokens, full.usage.total_tokens) == (n_prompt, 8, n_prompt + 8)
    assert full.usage.prompt_tokens_details.cached_tokens == 0

    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, **GREEDY, "stream_options": {"include_usage": True}}
    chunks = stream_events(live, "/v1/completions", body)
    *text_chunks, usage_chunk = chunks
    assert len({c["id"] for c in chunks}) == 1 and len({c["created"] for c in chunks}) == 1
    for c in text_chunks:
        assert set(c) == {"id", "object", "created", "model", "choices", "system_fingerprint", "usage"}
        assert c["object"] == "text_completion" and c["model"] == MODEL and c["usage"] is None
        (ch,) = c["choices"]
        assert set(ch) == {"index", "text", "logprobs", "finish_reason"}
        assert ch["index"] == 0 and isinstance(ch["text"], str) and ch["logprobs"] is None
    reasons = [c["choices"][0]["finish_reason"] for c in text_chunks]
    assert reasons == [None] * (len(reasons) - 1) + ["length"]
    assert "".join(c["choices"][0]["text"] for c in text_chunks) == choice.text
    assert usage_chunk["choices"] == [] and usage_chunk["object"] == "text_completion"
    assert usage_chunk["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": 8, "total_tokens": n_prompt + 8,
                                    "prompt_tokens_details": {"cached_tokens": usage_chunk["usage"]
                                                              ["prompt_tokens_details"]["cached_tokens"]}}

    # The official client's streaming path agrees too.
    streamed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, stream=True,
                                         extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed) == choice.text


def test_chat_stream_equals_non_stream_and_chunks_have_openai_shape(live, client, tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=6, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert full.object == "chat.completion" and full.id.startswith("chatcmpl-")
    (choice,) = full.choices
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    n_prompt = len(tokenizer.apply_chat_template(messages))
    assert (full.usage.prompt_tokens, full.usage.completion_tokens) == (n_prompt, 6)

    chunks = stream_events(live, "/v1/chat/completions",
                           {"model": MODEL, "messages": messages, "max_tokens": 6, **GREEDY})
    for c in chunks:
        assert set(c) == {"id", "object", "created", "model", "choices", "system_fingerprint"}
        assert c["object"] == "chat.completion.chunk"
        (ch,) = c["choices"]
        assert set(ch) == {"index", "delta", "logprobs", "finish_reason"} and ch["index"] == 0
    first, *rest = chunks
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all("role" not in c["choices"][0]["delta"] for c in rest)
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == choice.message.content

    streamed = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                              stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == choice.message.content


def test_n2_seeded_samples_stream_equal_non_stream_and_usage_counts_both(live, client):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 5, "n": 2, "temperature": 1.0, "seed": 1234,
            "ignore_eos": True}
    full = httpx.post(f"{live.url}/v1/completions", json=body, timeout=300).json()
    texts = {c["index"]: c["text"] for c in full["choices"]}
    assert sorted(texts) == [0, 1]
    assert texts[0] != texts[1]  # sample i is seeded with seed + i
    assert full["usage"]["completion_tokens"] == 10
    chunks = stream_events(live, "/v1/completions", body)
    streamed = {0: "", 1: ""}
    finishes = {}
    for c in chunks:
        (ch,) = c["choices"]
        assert ch["index"] not in finishes, "a choice sent text after its finish_reason"
        streamed[ch["index"]] += ch["text"]
        if ch["finish_reason"] is not None:
            finishes[ch["index"]] = ch["finish_reason"]
    assert streamed == texts and finishes == {0: "length", 1: "length"}


def test_list_prompt_choices_are_indexed_prompt_times_n_plus_sample(live, client, tokenizer):
    other = "Once upon a time"
    singles = [greedy_completion(client, p, 4) for p in (PROMPT, other)]
    out = client.completions.create(model=MODEL, prompt=[PROMPT, other], n=2, max_tokens=4, temperature=0,
                                    extra_body={"ignore_eos": True})
    by_index = {c.index: c.text for c in out.choices}
    assert by_index == {0: singles[0], 1: singles[0], 2: singles[1], 3: singles[1]}
    assert out.usage.prompt_tokens == len(tokenizer.encode(PROMPT)) + len(tokenizer.encode(other))
    assert out.usage.completion_tokens == 16
    # Token-id prompts (one list, and a list of lists) give the same text as the string prompt.
    ids = tokenizer.encode(PROMPT)
    assert greedy_completion(client, ids, 4) == singles[0]
    both = client.completions.create(model=MODEL, prompt=[ids, tokenizer.encode(other)], max_tokens=4,
                                     temperature=0, extra_body={"ignore_eos": True})
    assert [c.text for c in sorted(both.choices, key=lambda c: c.index)] == singles
    # Streamed, the two prompts' chunks interleave; each choice still reassembles to its text.
    chunks = stream_events(live, "/v1/completions", {"model": MODEL, "prompt": [PROMPT, other], "max_tokens": 4,
                                                     **GREEDY, "stream_options": {"include_usage": True}})
    streamed = {0: "", 1: ""}
    for c in chunks[:-1]:
        streamed[c["choices"][0]["index"]] += c["choices"][0]["text"]
    assert streamed == {0: singles[0], 1: singles[1]}
    assert chunks[-1]["usage"]["completion_tokens"] == 8


def test_completion_logprobs_greedy_token_is_the_most_likely(live, client):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "logprobs": 3, **GREEDY}
    full = httpx.post(f"{live.url}/v1/completions", json=body, timeout=300).json()
    lp = full["choices"][0]["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 4
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    for token, chosen, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert chosen <= 0.0 and 1 <= len(top) <= 4 and token in top
        assert chosen >= max(top.values()) - 1e-5  # greedy picks the argmax
    streamed = stream_events(live, "/v1/completions", body)
    s_lps = [x for c in streamed for x in c["choices"][0]["logprobs"]["token_logprobs"]]
    assert s_lps == pytest.approx(lp["token_logprobs"], abs=1e-5)


def test_chat_logprobs_have_token_bytes_and_sorted_alternatives(live, client):
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                         temperature=0, logprobs=True, top_logprobs=2,
                                         extra_body={"ignore_eos": True})
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens == 3
    for item in content:
        assert len(item.top_logprobs) == 2
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
        assert item.top_logprobs[0].token == item.token  # greedy
        assert item.logprob == pytest.approx(item.top_logprobs[0].logprob)
        assert bytes(item.bytes).decode("utf-8", errors="replace") == item.token


def test_stop_string_truncates_and_finishes_with_stop(live, client):
    text = greedy_completion(client, PROMPT, 10)
    assert len(text) >= 6, f"greedy text too short for this test: {text!r}"
    stop = text[3:6]
    expected = text[: text.find(stop)]
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0, stop=[stop, "\x00zz"],
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].text == expected and out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens < 10  # the stop ended generation early; later tokens are not counted
    chunks = stream_events(live, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 10,
                                                     "stop": stop, **GREEDY})
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    kept = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0, stop=stop,
                                     extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    assert kept.choices[0].text == expected + stop


def test_stream_is_not_buffered(live):
    """The first text chunk arrives long before the last: tokens are sent as they are produced.
    48 tokens: with 12, a decode step of ~20 ms left the first chunk (prefill + one step) at a third
    of the whole stream, and a busy host (the other test worker compiling) pushed it past 0.35."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 48, **GREEDY, "stream": True}
    start = time.monotonic()
    arrivals = []
    with httpx.stream("POST", f"{live.url}/v1/completions", json=body, timeout=300) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                arrivals.append(time.monotonic() - start)
    total = time.monotonic() - start
    assert len(arrivals) >= 6
    assert arrivals[0] < 0.35 * total, (arrivals, total)
    assert arrivals[-1] - arrivals[0] > 0.5 * (total - arrivals[0])  # chunks spread over the generation


def test_models_health_and_metrics_endpoints(live, client):
    greedy_completion(client, PROMPT, 8)  # decode steps for the step clock
    models = httpx.get(f"{live.url}/v1/models").json()
    assert models["object"] == "list"
    (m,) = models["data"]
    assert m["id"] == MODEL and m["object"] == "model" and m["max_model_len"] == 512
    health = httpx.get(f"{live.url}/health").json()  # fully warmed: every program compiled
    assert health["status"] == "ok" and health["programs_compiled"] == health["programs_declared"] > 0
    metrics = live.metrics()
    for name in ("time_to_first_token_seconds_count", "time_per_output_token_seconds_count",
                 "inter_token_latency_seconds_count", "e2e_request_latency_seconds_count",
                 "request_queue_time_seconds_count", "prompt_tokens_total", "generation_tokens_total",
                 "request_success_total{finished_reason=length}", "num_preemptions_total",
                 "prefix_cache_queries_total", "prefix_cache_hits_total", "compilations_after_warmup_total",
                 "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "num_kv_pages_used",
                 "programs_compiled", "programs_declared"):
        assert f"jaxserve:{name}" in metrics, name
    assert metrics["jaxserve:time_to_first_token_seconds_count"] > 0
    assert metrics["jaxserve:request_queue_time_seconds_count"] > 0
    assert metrics["jaxserve:compilations_after_warmup_total"] == 0
    decode = {k: v for k, v in metrics.items() if k.startswith("jaxserve:decode_step_seconds_count{rows=")}
    assert decode and sum(decode.values()) > 0
    for key, count in decode.items():
        bucket = key[key.index("{"):]
        assert metrics[f"jaxserve:decode_step_seconds_sum{bucket}"] > 0 or count == 0
        assert count <= metrics[f"jaxserve:decode_step_sequences_total{bucket}"] <= count * int(bucket[6:-1])
        assert metrics[f"jaxserve:decode_step_context_tokens_total{bucket}"] >= metrics[
            f"jaxserve:decode_step_sequences_total{bucket}"]
    assert not [k for k in metrics if k.startswith("vllm:")]  # vLLM's names only with --vllm-metric-names
    (info,) = [k for k in metrics if k.startswith("jaxserve:cache_config_info{")]
    labels = dict(kv.split("=") for kv in info[info.index("{") + 1:-1].split(","))
    assert labels["cache_dtype"] == "auto" and int(labels["num_pages"]) == metrics["jaxserve:num_kv_pages_total"]
    assert int(labels["pool_tokens"]) == int(labels["num_pages"]) * int(labels["page_size"])
    assert int(labels["bytes_per_token"]) * int(labels["pool_tokens"]) == int(labels["pool_bytes"])


def test_cache_salt_separates_prefix_cache_namespaces(live, client):
    prompt = " ".join(f"word{i}" for i in range(40))  # > 3 full KV pages of 16 tokens

    def cached(salt: str) -> int:
        out = httpx.post(f"{live.url}/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1,
                                                             "cache_salt": salt}, timeout=300).json()
        return out["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached("tenant-a") == 0
    assert cached("tenant-a") >= 32
    assert cached("tenant-b") == 0


def test_client_disconnect_aborts_request_and_frees_pages(live):
    before = live.wait_idle()
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 200, **GREEDY, "stream": True}
    with httpx.stream("POST", f"{live.url}/v1/completions", json=body, timeout=300) as r:
        seen = 0
        for line in r.iter_lines():
            if line.startswith("data: {"):
                seen += 1
                if seen == 3:
                    break
    after = live.wait_idle(timeout=30)
    key = "jaxserve:request_success_total{finished_reason=abort}"
    assert after[key] == before[key] + 1
    generated = after["jaxserve:generation_tokens_total"] - before["jaxserve:generation_tokens_total"]
    assert 3 <= generated < 200
    assert after["jaxserve:kv_cache_usage_perc"] == 0


def test_100_concurrent_streams_match_their_sequential_greedy_output(live, client):
    prompts = [f"Story number {i} begins" for i in range(5)]
    expected = {p: greedy_completion(client, p, 4) for p in prompts}
    aclient = openai.AsyncOpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0, timeout=600)

    async def one(prompt: str) -> str:
        stream = await aclient.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0,
                                                  stream=True, extra_body={"ignore_eos": True})
        return "".join([c.choices[0].text async for c in stream])

    async def run_all() -> list[str]:
        try:
            return await asyncio.gather(*(one(prompts[i % 5]) for i in range(100)))
        finally:
            await aclient.close()

    results = asyncio.run(run_all())
    assert results == [expected[prompts[i % 5]] for i in range(100)]
    m = live.wait_idle(timeout=30)
    assert m["jaxserve:kv_cache_usage_perc"] == 0


def test_request_the_engine_can_never_run_is_a_400(live):
    """n above max_num_seqs passes the field checks but is refused by the engine at submit."""
    r = httpx.post(f"{live.url}/v1/completions", json={"model": MODEL, "prompt": "hi", "n": 17}, timeout=60)
    assert r.status_code == 400
    assert "max_num_seqs" in r.json()["error"]["message"]
