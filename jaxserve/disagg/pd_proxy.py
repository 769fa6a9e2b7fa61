"""`jaxserve proxy --prefill URL --decode URL`: prefill/decode disaggregation behind one OpenAI API.

Each completion or chat request goes first to a prefill instance (`serve --kv-role prefill`) as
itself with max_tokens 1, n 1 and no streaming: it computes the prompt's K/V, whose full pages stay
in its prefix cache. Then the original request goes to a decode instance (`serve --kv-role
decode`) with `"kv_transfer_params": {"remote_url": <that prefill instance>}`: the decode instance
fetches those pages, enters them into its own prefix cache and generates the whole output,
streamed back through here as it arrives (kv_transfer.py says why the output is the colocated
one). Several prefill or decode URLs are taken in turn. A prefill error is answered as is; a
failed transfer is the decode instance's 502/504.
"""

from __future__ import annotations

import itertools
import json
from typing import Sequence

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from jaxserve.distributed.replicas import serve_replicas
from jaxserve.distributed.router import client_lifespan, error, json_body, relay


def prefill_body(body: dict) -> dict:
    """The request as the prefill instance runs it: one token, one sample, no stream."""
    out = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "n", "best_of")}
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    return out


def build_pd_proxy(prefill: list[str], decode: list[str], timeout: float = 600.0) -> Starlette:
    if not prefill or not decode:
        raise ValueError("the proxy needs at least one prefill and one decode URL")
    prefills = itertools.cycle([u.rstrip("/") for u in prefill])
    decodes = itertools.cycle([u.rstrip("/") for u in decode])
    first_decode = decode[0].rstrip("/")
    client: dict[str, httpx.AsyncClient] = {}

    lifespan = client_lifespan(client, timeout)

    async def forward(request: Request) -> Response:
        raw = await request.body()
        body = json_body(raw)
        if isinstance(body, JSONResponse):
            return body
        p, d = next(prefills), next(decodes)
        auth = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
        try:
            first = await client["c"].post(p + request.url.path, json=prefill_body(body), headers=auth)
        except httpx.HTTPError as e:
            return error(502, f"prefill instance {p} cannot be reached: {type(e).__name__}", "prefill_unreachable")
        if first.status_code != 200:  # the request's own fault (or the prefill's): as the prefill said it
            return Response(first.content, first.status_code, media_type="application/json")
        content = json.dumps({**body, "kv_transfer_params": {"remote_url": p}}).encode()
        return await relay(client["c"], request, d + request.url.path, content, f"decode instance {d}")

    async def to_decode(request: Request) -> Response:
        """The model list, the tokenizer and the version: the first decode instance's."""
        return await relay(client["c"], request, first_decode + request.url.path, await request.body(),
                           f"decode instance {first_decode}")

    async def health(request: Request) -> Response:
        for url in (*prefill, *decode):
            try:
                if (await client["c"].get(url.rstrip("/") + "/health", timeout=5.0)).status_code != 200:
                    return Response(status_code=503)
            except httpx.HTTPError:
                return Response(status_code=503)
        return Response(status_code=200)

    return Starlette(routes=[
        Route("/v1/completions", forward, methods=["POST"]),
        Route("/v1/chat/completions", forward, methods=["POST"]),
        Route("/v1/models", to_decode, methods=["GET"]),
        Route("/tokenize", to_decode, methods=["POST"]),
        Route("/detokenize", to_decode, methods=["POST"]),
        Route("/version", to_decode, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
    ], lifespan=lifespan)


def serve_disaggregated(argv: Sequence[str], prefill: int, decode: int, devices_per_replica: int, host: str,
                        port: int, log_level: str = "info") -> int:
    """`serve --disaggregate P:D`: P prefill and D decode instances behind the PD proxy."""
    roles = [("--kv-role", "prefill")] * prefill + [("--kv-role", "decode")] * decode
    return serve_replicas(argv, roles, devices_per_replica, host, port,
                          lambda urls: build_pd_proxy(urls[:prefill], urls[prefill:]), log_level)
