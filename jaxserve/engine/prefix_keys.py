"""Prefix-cache keys: page i's key is sha256(key of page i-1 || its token ids), the first page's
parent derived from the namespace (model id + adapter + per-tenant salt)."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence as Seq


def namespace_key(namespace: str) -> bytes:
    return hashlib.sha256(b"jaxserve-prefix\x00" + namespace.encode("utf-8")).digest()


def page_key(parent: bytes, tokens: Seq[int]) -> bytes:
    return hashlib.sha256(parent + array("q", tokens).tobytes()).digest()


def host_page(index: int) -> int:
    """How `match_prefix` lists a hit in the host tier: negative, so device pages stay >= 0."""
    return -1 - index
