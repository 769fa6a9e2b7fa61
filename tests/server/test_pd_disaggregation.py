"""Prefill/decode disaggregation on this machine: a `--kv-role prefill` server, a `--kv-role decode`
server and `jaxserve proxy` in front (real uvicorn servers, the official openai client). Through
the proxy the outputs are those of one colocated server, greedy and seeded, streamed or not; the
decode instance imports the prompt's pages (host-staged over HTTP, or pulled over
jax.experimental.transfer) and computes only the prompt's last page itself; a
prefill instance that cannot be reached fails the request with a clear error and harms nothing."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest


from server_utils import MODEL, TEST_ENGINE, LiveServer, client_for, start_server

PROMPTS = ["The history of the printing press begins in " * 6, "def merge_sort(items):\n    " * 8]


class Proxy(LiveServer):
    """LiveServer for an app without a ServerState (the proxy)."""

    def __init__(self, app) -> None:  # noqa: ANN001
        app.state.server = None
        super().__init__(app)


@pytest.fixture(scope="module")
def pd():
    from jaxserve.core.config import EngineConfig
    from jaxserve.engine.loading import load_engine_core
    from jaxserve.disagg.pd_proxy import build_pd_proxy

    def core(role: str):  # noqa: ANN202
        return load_engine_core(None, EngineConfig(model_id=MODEL, kv_role=role, **TEST_ENGINE))

    servers = {"prefill": start_server(core("prefill")), "decode": start_server(core("decode")),
               "decode-jax": start_server(core("decode"), kv_transport="jax")}
    proxy = Proxy(build_pd_proxy([servers["prefill"].url], [servers["decode"].url]))
    servers["proxy-jax"] = Proxy(build_pd_proxy([servers["prefill"].url], [servers["decode-jax"].url]))
    yield servers, proxy
    for s in (proxy, servers.pop("proxy-jax")):
        s.server.should_exit = True
    for s in servers.values():
        s.stop()


def _ask(url: str, prompt: str, stream: bool, **params) -> str:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
    if not stream:
        return client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, **params).choices[0].text
    return "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=12, stream=True, **params) if c.choices)


@pytest.mark.parametrize("params", [dict(temperature=0.0), dict(temperature=0.8, seed=7)], ids=["greedy", "seeded"])
@pytest.mark.parametrize("stream", [False, True])
def test_the_proxy_gives_the_colocated_output(pd, params, stream):
    servers, proxy = pd
    decode = servers["decode"]
    for i, prompt in enumerate(PROMPTS):
        prompt = f"{i}{stream}{params.get('seed')} {prompt}"  # a fresh prompt: its pages come from the prefill
        before = decode.metrics()
        got = _ask(proxy.url, prompt, stream, **params)
        after = decode.metrics()
        imported = after["jaxserve:kv_imported_pages_total"] - before["jaxserve:kv_imported_pages_total"]
        hits = after["jaxserve:prefix_cache_hits_total"] - before["jaxserve:prefix_cache_hits_total"]
        assert imported >= 2 and hits == imported * 16  # every imported page was a prefix hit
        assert got == _ask(servers["prefill"].url, prompt, stream, **params)  # colocated: it computed all itself
    assert servers["prefill"].metrics()["jaxserve:kv_exported_pages_total"] > 0
    assert decode.metrics()["jaxserve:compilations_after_warmup_total"] == 0


@pytest.mark.parametrize("params", [dict(temperature=0.0), dict(temperature=0.8, seed=7)], ids=["greedy", "seeded"])
def test_pages_pulled_over_jax_transfer_give_the_colocated_output(pd, params):
    """--kv-transport jax: the decode instance pulls the offered pages from the prefill instance's
    jax.experimental.transfer server onto its own devices (kv_pull.py)."""
    servers, _ = pd
    decode = servers["decode-jax"]
    for i, prompt in enumerate(PROMPTS):
        prompt = f"jax{i}{params.get('seed')} {prompt}"
        before, exported = decode.metrics(), servers["prefill"].metrics()["jaxserve:kv_exported_pages_total"]
        got = _ask(servers["proxy-jax"].url, prompt, False, **params)
        after = decode.metrics()
        imported = after["jaxserve:kv_imported_pages_total"] - before["jaxserve:kv_imported_pages_total"]
        hits = after["jaxserve:prefix_cache_hits_total"] - before["jaxserve:prefix_cache_hits_total"]
        assert imported >= 2 and hits == imported * 16
        assert servers["prefill"].metrics()["jaxserve:kv_exported_pages_total"] - exported == imported
        assert got == _ask(servers["prefill"].url, prompt, False, **params)
    assert decode.metrics()["jaxserve:compilations_after_warmup_total"] == 0
    decode.wait_idle()
    decode.state.core.allocator.check_invariants()


def test_a_stalled_pull_times_out_clearly_while_the_instance_keeps_serving(pd, monkeypatch):
    """An offer whose pages never come (a transfer server that never offers its uuid): the request
    fails with a 504 naming the remote after the transport's timeout, and meanwhile the decode
    instance serves other requests (the pull waits on a worker thread, not the engine's)."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import transfer
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from jaxserve.server import kv_routes

    servers, _ = pd
    decode = servers["decode-jax"]
    pool = jax.tree.leaves(decode.state.core.runner.kv)
    silent = transfer.start_transfer_server(jax.devices()[0].client, "127.0.0.1:0", ["127.0.0.1:0"])
    offer = {"pages": 3, "port": int(silent.address().rsplit(":", 1)[1]), "uuid": 424242, "runs": [2, 1],
             "bytes": 0, "leaves": [[leaf.dtype.name, list(leaf.shape[1:])] for leaf in pool]}
    asked = threading.Event()

    async def export(request):  # noqa: ANN001, ANN202
        asked.set()
        return JSONResponse(offer)

    fake_prefill = Proxy(Starlette(routes=[Route("/v1/kv/export", export, methods=["POST"])]))
    monkeypatch.setattr(kv_routes.TRANSPORTS["jax"], "timeout", 4.0)
    try:
        with ThreadPoolExecutor(1) as pool_thread:
            stuck = pool_thread.submit(httpx.post, f"{decode.url}/v1/completions", timeout=60, json={
                "model": MODEL, "prompt": "stalled " * 60, "max_tokens": 2,
                "kv_transfer_params": {"remote_url": fake_prefill.url}})
            assert asked.wait(30)
            time.sleep(0.2)  # the pull has started
            assert _ask(decode.url, "served meanwhile", False, temperature=0.0)
            assert not stuck.done()  # still waiting on its pages while the other request was served
            r = stuck.result()
        assert r.status_code == 504, r.text
        assert f"the KV transfer from {fake_prefill.url} timed out after 4s" in r.json()["error"]["message"]
    finally:  # let the abandoned pull finish, so its thread ends
        silent.await_pull(424242, [jnp.zeros((w, *leaf.shape[1:]), leaf.dtype) for w in (2, 1) for leaf in pool])
        fake_prefill.server.should_exit = True
    decode.wait_idle()
    decode.state.core.allocator.check_invariants()


def test_a_malformed_offer_is_a_502_naming_the_prefill_instance(pd):
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    async def export(request):  # noqa: ANN001, ANN202
        return JSONResponse({"pages": 3, "port": "x", "uuid": 1, "bytes": 0, "runs": [2, 1], "leaves": []})

    fake_prefill = Proxy(Starlette(routes=[Route("/v1/kv/export", export, methods=["POST"])]))
    try:
        r = httpx.post(f"{pd[0]['decode-jax'].url}/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": "offered " * 60, "max_tokens": 2,
            "kv_transfer_params": {"remote_url": fake_prefill.url}})
    finally:
        fake_prefill.server.should_exit = True
    assert r.status_code == 502 and f"the KV transfer from {fake_prefill.url} failed: not an offer" in r.text


def test_chat_through_the_proxy(pd):
    servers, proxy = pd
    messages = [{"role": "user", "content": "Tell me about paged attention. " * 6}]
    client = lambda url: openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)  # noqa: E731
    got = client(proxy.url).chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    want = client(servers["decode"].url).chat.completions.create(model=MODEL, messages=messages, max_tokens=8,
                                                                 temperature=0)
    assert got.choices[0].message.content == want.choices[0].message.content


def test_the_tokenizer_routes_and_the_model_list_are_the_decode_instances(pd):
    servers, proxy = pd
    for method, path, body in [("POST", "/tokenize", {"messages": [{"role": "user", "content": "hi"}]}),
                               ("POST", "/detokenize", {"tokens": [9707, 1879]}), ("GET", "/version", None)]:
        got = httpx.request(method, proxy.url + path, json=body, timeout=60)
        want = httpx.request(method, servers["decode"].url + path, json=body, timeout=60)
        assert got.status_code == 200 and got.json() == want.json(), (path, got.text)
    models = httpx.get(proxy.url + "/v1/models", timeout=60).json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    bad = httpx.post(proxy.url + "/detokenize", json={"tokens": [-1]}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"  # the instance's own answer


def test_an_unreachable_prefill_instance_fails_the_request_clearly(pd):
    servers, _ = pd
    decode = servers["decode"]
    r = httpx.post(f"{decode.url}/v1/completions", json={
        "model": MODEL, "prompt": "hello " * 40, "max_tokens": 4,
        "kv_transfer_params": {"remote_url": "http://127.0.0.1:9"}})
    assert r.status_code == 502 and "the KV transfer from http://127.0.0.1:9 failed" in r.json()["error"]["message"]
    assert _ask(decode.url, "still serving", False, temperature=0.0)  # nothing harmed
    decode.wait_idle()
    decode.state.core.allocator.check_invariants()


def test_a_decode_instance_that_is_gone_fails_the_request_clearly(pd):
    """The proxy's decode instance does not answer: 502 naming it; the prefill instance's pages for
    the prompt stay evictable prefix-cache pages (nothing owned, invariants hold) and it serves on."""
    from jaxserve.disagg.pd_proxy import build_pd_proxy

    servers, _ = pd
    prefill = servers["prefill"]
    proxy = Proxy(build_pd_proxy([prefill.url], ["http://127.0.0.1:9"]))
    try:
        r = httpx.post(f"{proxy.url}/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": "the decode side is gone " * 12, "max_tokens": 4})
    finally:
        proxy.server.should_exit = True
    assert r.status_code == 502, r.text
    assert "decode instance http://127.0.0.1:9 cannot be reached" in r.json()["error"]["message"]
    prefill.wait_idle()
    prefill.state.core.allocator.check_invariants()
    allocator = prefill.state.core.allocator
    assert allocator.num_free_pages == allocator.num_pages  # every page free or evictable
    assert _ask(prefill.url, "still serving", False, temperature=0.0)


def test_kv_roles_refuse_what_they_do_not_do(pd):
    servers, _ = pd
    r = httpx.post(f"{servers['decode'].url}/v1/kv/export", json={"prompt_token_ids": [1, 2, 3]})
    assert r.status_code == 400 and "--kv-role prefill" in r.json()["error"]["message"]
    r = httpx.post(f"{servers['prefill'].url}/v1/completions", json={
        "model": MODEL, "prompt": "x", "max_tokens": 1, "kv_transfer_params": {"remote_url": "http://a"}})
    assert r.status_code == 400 and "--kv-role decode" in r.json()["error"]["message"]
    r = httpx.post(f"{servers['decode'].url}/v1/completions", json={
        "model": MODEL, "prompt": "x", "max_tokens": 1, "kv_transfer_params": {"remote_url": 3}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params"



def test_a_prompt_shorter_than_a_page_ships_nothing_and_still_works(pd):
    servers, proxy = pd
    assert _ask(proxy.url, "hi", True, temperature=0.0) == _ask(servers["prefill"].url, "hi", True, temperature=0.0)
