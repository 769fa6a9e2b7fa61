"""PD disaggregation on the HTTP side (kv_transfer.py): a prefill instance's POST /v1/kv/export, and
a decode instance's fetch + import of a request's prompt pages before it is submitted."""

from __future__ import annotations

import asyncio
import logging
import time
from starlette.requests import Request
from starlette.responses import Response

from jaxserve.kv_transfer import HttpKVTransport, KVTransport, TransferError, decode_pages, encode_pages
from jaxserve.server.errors import APIError, bad_request
from jaxserve.server.protocol import parse_json_body
from jaxserve.server.state import ServerState

logger = logging.getLogger("jaxserve.kv_transfer")

TRANSPORT: KVTransport = HttpKVTransport()


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
    written = 0
    for ids in prompts:
        try:
            t0 = time.perf_counter()
            payload = await TRANSPORT.fetch(remote, ids, cache_salt)
            num_pages, leaves = decode_pages(payload)
            written += await asyncio.wrap_future(state.core.import_prefix(ids, cache_salt, num_pages, leaves))
            seconds = time.perf_counter() - t0
            logger.info("KV transfer: %d pages (%.2f MiB) from %s in %.1f ms (%.0f MiB/s)", num_pages,
                        len(payload) / 2**20, remote, seconds * 1e3, len(payload) / 2**20 / max(seconds, 1e-9))
        except TransferError as e:
            raise APIError(504 if "timed out" in str(e) else 502, str(e), "kv_transfer_error", "kv_transfer_params",
                           "kv_transfer_failed") from None
        except ValueError as e:
            raise APIError(502, f"the KV pages from {remote} cannot be used: {e}", "kv_transfer_error",
                           "kv_transfer_params", "kv_transfer_misfit") from None
    return written
