"""Prefill/decode disaggregation's KV shipping: page contents as bytes, and how a decode instance
fetches them from a prefill instance (host-side; no jax).

A prefill instance (`serve --kv-role prefill`) serves POST /v1/kv/export {"prompt_token_ids",
"cache_salt"}: the K/V of the full pages its prefix cache holds for those tokens. A decode instance
(`serve --kv-role decode`) given a request with `"kv_transfer_params": {"remote_url": URL}` fetches
them (KVTransport), enters them into its own prefix cache (EngineCore.import_prefix), then admits
the request, whose prompt is then a prefix-cache hit but for its last token. So the decode instance
generates every output token itself, with the same keys and sampler as a colocated server: its
outputs are the colocated ones, greedy or seeded.

Two transports (`serve --kv-transport`, chosen by the decode instance): `http` ships the pages'
bytes in the export's response (HttpKVTransport, below); `jax` asks the prefill instance to offer
them on its jax.experimental.transfer server and pulls them device to device (JaxKVTransport
fetches the offer; kv_pull.py moves the arrays).

Wire format (http): 4-byte little-endian header length, a JSON header {"pages": n, "leaves": [[dtype,
shape], ...]}, then each leaf's bytes in order (the pool's jax.tree.leaves order; [n, ...] each).
Not safetensors: its numpy API refuses the dtypes KV pages have on accelerators (bfloat16, float8:
`KeyError: 'BF16'` in safetensors 0.8), and this is the whole codec.
"""

from __future__ import annotations

import json
from typing import Protocol

import httpx
import numpy as np

from jaxserve.core.config import KV_TRANSFER_TIMEOUT_S as TRANSFER_TIMEOUT_S


def encode_pages(leaves: list[np.ndarray]) -> bytes:
    n = int(leaves[0].shape[0]) if leaves else 0
    header = json.dumps({"pages": n, "leaves": [[leaf.dtype.name, list(leaf.shape)] for leaf in leaves]}).encode()
    return len(header).to_bytes(4, "little") + header + b"".join(np.ascontiguousarray(l).tobytes() for l in leaves)


def decode_pages(payload: bytes) -> tuple[int, list[np.ndarray]]:
    """(pages, leaves); ValueError when the bytes are not a page payload."""
    import ml_dtypes  # noqa: F401  (registers bfloat16 / float8 names with numpy)

    try:
        size = int.from_bytes(payload[:4], "little")
        header = json.loads(payload[4:4 + size])
        leaves, offset = [], 4 + size
        for dtype, shape in header["leaves"]:
            dt = np.dtype(getattr(ml_dtypes, dtype, dtype))
            count = int(np.prod(shape))
            leaves.append(np.frombuffer(payload, dt, count, offset).reshape(shape))
            offset += count * dt.itemsize
        if offset != len(payload):
            raise ValueError(f"{len(payload) - offset} bytes past the last leaf")
        return int(header["pages"]), leaves
    except (KeyError, TypeError, json.JSONDecodeError) as e:
        raise ValueError(f"not a KV page payload: {e}") from None


class TransferError(RuntimeError):
    pass


async def _export(remote_url: str, body: dict, timeout: float) -> httpx.Response:
    """POST /v1/kv/export on a prefill instance; TransferError naming the remote on failure."""
    url = remote_url.rstrip("/") + "/v1/kv/export"
    try:
        async with httpx.AsyncClient(timeout=timeout) as client:
            r = await client.post(url, json=body)
    except httpx.TimeoutException:
        raise TransferError(f"the KV transfer from {remote_url} timed out after {timeout:g}s") from None
    except httpx.HTTPError as e:
        raise TransferError(f"the KV transfer from {remote_url} failed: {type(e).__name__}: {e}") from None
    if r.status_code != 200:
        raise TransferError(f"the KV transfer from {remote_url} failed: HTTP {r.status_code}: {r.text[:200]}")
    return r


class KVTransport(Protocol):
    name: str

    async def fetch(self, remote_url: str, prompt_token_ids: list[int], cache_salt: str | None) -> bytes | dict:
        """What the prefill instance exports for a prompt (the page payload, or an offer to pull);
        raises TransferError naming the remote and the problem."""


class HttpKVTransport:
    """Host-staged over HTTP (TCP): the prefill instance's /v1/kv/export. Works on every backend."""

    name = "http"

    def __init__(self, timeout: float = TRANSFER_TIMEOUT_S) -> None:
        self.timeout = timeout

    async def fetch(self, remote_url: str, prompt_token_ids: list[int], cache_salt: str | None) -> bytes:
        body = {"prompt_token_ids": prompt_token_ids, "cache_salt": cache_salt}
        return (await _export(remote_url, body, self.timeout)).content


class JaxKVTransport:
    """jax.experimental.transfer: the export answers with an offer (kv_pull.TransferEndpoint.offer)
    that the decode engine pulls from the prefill instance's transfer server."""

    name = "jax"

    def __init__(self, timeout: float = TRANSFER_TIMEOUT_S) -> None:
        self.timeout = timeout

    async def fetch(self, remote_url: str, prompt_token_ids: list[int], cache_salt: str | None) -> dict:
        body = {"prompt_token_ids": prompt_token_ids, "cache_salt": cache_salt, "transport": "jax"}
        r = await _export(remote_url, body, self.timeout)
        try:
            offer = r.json()
            ints = [offer[k] for k in ("pages", "port", "uuid", "bytes")] + list(offer["runs"])
            if not all(isinstance(v, int) and v >= 0 for v in ints) or sum(offer["runs"]) != offer["pages"]:
                raise ValueError("page counts, port, uuid and bytes must be non-negative integers, runs summing "
                                 "to pages")
            if not all(isinstance(leaf, list) and len(leaf) == 2 for leaf in offer["leaves"]):
                raise ValueError("leaves must be [dtype, shape] pairs")
        except (ValueError, KeyError, TypeError) as e:
            raise TransferError(f"the KV transfer from {remote_url} failed: not an offer: {e}") from None
        return offer
