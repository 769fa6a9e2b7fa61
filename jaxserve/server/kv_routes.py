"""PD disaggregation on the HTTP side (kv_transfer.py): a prefill instance's POST /v1/kv/export, and
a decode instance's fetch + import of a request's prompt pages before it is submitted."""

from __future__ import annotations

import asyncio
import logging
import time
from urllib.parse import urlparse

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from jaxserve.disagg.kv_transfer import (HttpKVTransport, JaxKVTransport, KVTransport, TransferError, decode_pages,
                                  encode_pages)
from jaxserve.server.errors import APIError, bad_request
from jaxserve.server.protocol import parse_json_body
from jaxserve.server.state import ServerState

logger = logging.getLogger("jaxserve.disagg.kv_transfer")

TRANSPORTS: dict[str, KVTransport] = {t.name: t for t in (HttpKVTransport(), JaxKVTransport())}


async def export(state: ServerState, request: Request) -> Response:
    state.require_ready()
    if state.core.engine_cfg.kv_role != "prefill":
        raise bad_request("this server does not export KV pages: start it with --kv-role prefill")
    body = parse_json_body(await request.body())
    ids, salt = body.get("prompt_token_ids"), body.get("cache_salt")
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise bad_request("'prompt_token_ids' must be a list of token ids", "prompt_token_ids")
    if salt is not None and not isinstance(salt, str):
        raise bad_request("'cache_salt' must be a string", "cache_salt")
    transport = body.get("transport", "http")
    if transport not in TRANSPORTS:
        raise bad_request(f"'transport' must be one of {sorted(TRANSPORTS)}, got {transport!r}", "transport")
    if transport == "jax":  # an offer on this process's transfer server (kv_pull.py), pulled by the caller
        offer = await asyncio.wrap_future(state.core.export_prefix(ids, salt, offer_on=state.config.kv_transfer_host))
        return JSONResponse(offer)
    leaves = await asyncio.wrap_future(state.core.export_prefix(ids, salt))
    return Response(encode_pages(leaves), media_type="application/octet-stream")


def remote_of(state: ServerState, body: dict) -> str | None:
    """The prefill instance a request's `kv_transfer_params` names, or None; 400 when misused."""
    params = body.get("kv_transfer_params")
    if params is None:
        return None
    if state.core.engine_cfg.kv_role != "decode":
        raise bad_request("'kv_transfer_params' needs a decode instance (--kv-role decode)", "kv_transfer_params")
    remote = params.get("remote_url") if isinstance(params, dict) else None
    if not isinstance(remote, str) or not remote.startswith(("http://", "https://")):
        raise bad_request("'kv_transfer_params.remote_url' must be the prefill instance's http(s) URL",
                          "kv_transfer_params")
    return remote


async def import_prompts(state: ServerState, remote: str, prompts: list[list[int]], cache_salt: str | None) -> int:
    """Fetches each prompt's pages from `remote` and enters them into this engine's prefix cache;
    returns the pages written. A failed or misfit transfer fails the request (502/504) before
    anything is submitted; pages already imported stay cached (valid K/V under their keys)."""
    transport = TRANSPORTS[state.config.kv_transport]
    written = 0
    for ids in prompts:
        try:
            t0 = time.perf_counter()
            fetched = await transport.fetch(remote, ids, cache_salt)
            if isinstance(fetched, dict):  # an offer: pulled on a worker thread, so steps go on meanwhile
                num_pages, nbytes = int(fetched["pages"]), int(fetched["bytes"])
                runs = await _pull(state, remote, fetched, transport.timeout) if num_pages else []
                done = state.core.import_pulled(ids, cache_salt, fetched, runs)
            else:
                (num_pages, leaves), nbytes = decode_pages(fetched), len(fetched)
                done = state.core.import_prefix(ids, cache_salt, num_pages, leaves)
            written += await asyncio.wrap_future(done)
            seconds = time.perf_counter() - t0
            logger.info("KV transfer (%s): %d pages (%.2f MiB) from %s in %.1f ms (%.0f MiB/s)", transport.name,
                        num_pages, nbytes / 2**20, remote, seconds * 1e3, nbytes / 2**20 / max(seconds, 1e-9))
        except TransferError as e:
            raise APIError(504 if "timed out" in str(e) else 502, str(e), "kv_transfer_error", "kv_transfer_params",
                           "kv_transfer_failed") from None
        except ValueError as e:
            raise APIError(502, f"the KV pages from {remote} cannot be used: {e}", "kv_transfer_error",
                           "kv_transfer_params", "kv_transfer_misfit") from None
    return written


async def _pull(state: ServerState, remote: str, offer: dict, timeout: float) -> list:
    """EngineCore.pull_offer on a worker thread, bounded by the transport's timeout. A pull past it
    fails the request (504); its thread finishes or fails on its own (the transfer API cannot
    cancel a pull)."""
    pull = asyncio.get_running_loop().run_in_executor(
        None, state.core.pull_offer, urlparse(remote).hostname, offer, state.config.kv_transfer_host)
    try:
        return await asyncio.wait_for(asyncio.shield(pull), timeout)
    except asyncio.TimeoutError:
        raise TransferError(f"the KV transfer from {remote} timed out after {timeout:g}s "
                            "(pulling the offered pages)") from None
