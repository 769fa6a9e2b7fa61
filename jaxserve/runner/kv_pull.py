"""PD disaggregation's device transport (`--kv-transport jax`): a prefill instance offers a prompt's
pages as device arrays on a jax.experimental.transfer server, and the decode instance pulls them
straight into arrays placed like its own pool — device to device where the backend supports it
(each addressable shard moves on its own), through host sockets on a CPU. Nothing is staged in
Python bytes, unlike the HTTP transport (kv_transfer.py).

An offer is the pages in power-of-two runs (host_tier.gather_runs / scatter_runs: the same gather
and scatter programs as the host tier, warmed up once), each run every pool leaf [W, ...]. The
decode instance pulls before any page is keyed in its prefix cache, so a failed pull leaves
nothing behind; then it scatters each pulled row into its page (rows it already caches go to
an out-of-bounds page: dropped).

An offer nobody pulls (its decode instance gave up or died) expires after OFFER_LIFETIME_S; the
transfer server then drops its copy of the pages when it is next handed an offer, so abandoned
offers hold memory for a bounded time, never until the process ends.
"""

from __future__ import annotations

import datetime
import secrets
import threading
from typing import Any, Callable

import jax
import numpy as np

from jaxserve.model import kv_cache
from jaxserve.runner.host_tier import gather_runs
from jaxserve.core.config import KV_TRANSFER_TIMEOUT_S

# Twice what the puller waits: an offer still unpulled by then never will be.
OFFER_LIFETIME_S = 2 * KV_TRANSFER_TIMEOUT_S


class TransferEndpoint:
    """This process's transfer server (offers pages; connects to other instances' servers)."""

    def __init__(self, bind_host: str) -> None:
        from jax.experimental import transfer

        self._server = transfer.start_transfer_server(jax.devices()[0].client, f"{bind_host}:0", [f"{bind_host}:0"])
        self._connections: dict[str, Any] = {}
        self._lock = threading.Lock()  # pulls run on the server's worker threads

    @property
    def port(self) -> int:
        return int(self._server.address().rsplit(":", 1)[1])

    def offer(self, kv: kv_cache.KVPages, pages: list[int], put: Callable[[np.ndarray], jax.Array],
              lifetime_s: float = OFFER_LIFETIME_S) -> dict:
        """Offers the K/V of `pages` for one pull within `lifetime_s`; returns what the puller needs
        (JSON-able)."""
        gathered = gather_runs(kv, pages, put)
        runs = [run.k[0].shape[0] for run in gathered]
        arrays = jax.tree.leaves(gathered)
        uuid = secrets.randbits(62)
        if arrays:
            expires = datetime.datetime.now() + datetime.timedelta(seconds=lifetime_s)
            self._server.await_pull(uuid, arrays, timeout=expires)
        return {"pages": len(pages), "port": self.port, "uuid": uuid, "runs": runs,
                "bytes": int(sum(a.nbytes for a in arrays)),
                "leaves": [[leaf.dtype.name, list(leaf.shape[1:])] for leaf in jax.tree.leaves(kv)]}

    def pull(self, kv: kv_cache.KVPages, host: str, offer: dict) -> list[kv_cache.KVPages]:
        """The offered runs, placed like `kv` (one KVPages of W pages per run); blocks until they
        landed. Reads only the pool's shapes and shardings, so any thread may call it while steps
        run. Raises ValueError naming the remote when the pull fails."""
        if not offer["runs"]:
            return []
        address = f"{host}:{offer['port']}"
        leaves, treedef = jax.tree.flatten(kv)
        specs = [jax.ShapeDtypeStruct((width, *leaf.shape[1:]), leaf.dtype, sharding=leaf.sharding)
                 for width in offer["runs"] for leaf in leaves]
        try:
            with self._lock:
                if address not in self._connections:
                    self._connections[address] = self._server.connect(address)
                connection = self._connections[address]
            arrays = connection.pull(offer["uuid"], specs)
            jax.block_until_ready(arrays)
        except Exception as e:  # the transfer library raises its runtime's errors: name the remote
            with self._lock:
                self._connections.pop(address, None)
            raise ValueError(f"pulling the pages from {address} failed: {type(e).__name__}: {e}") from None
        n = len(leaves)
        return [jax.tree.unflatten(treedef, arrays[i * n:(i + 1) * n]) for i in range(len(offer["runs"]))]
