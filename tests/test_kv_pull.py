"""kv_pull.TransferEndpoint on its own (two endpoints in this process, as a prefill and a decode
instance would each hold one): an offer pulls back exactly the offered pages, placed like the
puller's pool; an offer nobody pulls gives its memory back once it has expired (at the transfer
server's next offer), while an unexpired one keeps it."""

from __future__ import annotations

import ctypes
import gc
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.model import kv_cache
from jaxserve.runner.kv_pull import TransferEndpoint


def _pool(pages: int, seed: int) -> kv_cache.KVPages:
    # one layer, [pages, page_size 16, 2 heads, 64] float32 = 8 KiB a page per leaf
    keys = jax.random.split(jax.random.key(seed), 2)
    return kv_cache.KVPages(k=[jax.random.normal(keys[0], (pages, 16, 2, 64))],
                            v=[jax.random.normal(keys[1], (pages, 16, 2, 64))])


def _rss_mib() -> float:
    """Resident MiB once freed heap memory went back to the system (a run of 64 pages is a heap
    block, which free() alone keeps; glibc's malloc_trim returns it)."""
    gc.collect()
    ctypes.CDLL(None).malloc_trim(0)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def test_a_pull_gets_exactly_the_offered_pages():
    prefill, decode = TransferEndpoint("127.0.0.1"), TransferEndpoint("127.0.0.1")
    kv, theirs = _pool(32, 0), _pool(32, 1)
    pages = [3, 4, 5, 9, 30, 1, 2]  # runs of 4, 2, 1
    offer = prefill.offer(kv, pages, jnp.asarray)
    assert offer["runs"] == [4, 2, 1] and offer["pages"] == 7
    runs = decode.pull(theirs, "127.0.0.1", offer)
    got_k = np.concatenate([np.asarray(r.k[0]) for r in runs])
    got_v = np.concatenate([np.asarray(r.v[0]) for r in runs])
    np.testing.assert_array_equal(got_k, np.asarray(kv.k[0])[pages])
    np.testing.assert_array_equal(got_v, np.asarray(kv.v[0])[pages])
    assert all(r.k[0].sharding == theirs.k[0].sharding for r in runs)


def test_an_offer_nobody_pulls_gives_its_memory_back_after_it_expires():
    endpoint = TransferEndpoint("127.0.0.1")
    kv = _pool(12_800, 2)  # 2 x 100 MiB
    jax.block_until_ready(kv)
    pages = list(range(12_800))
    _rss_mib()
    time.sleep(0.5)  # the pool's temporaries freed

    def held_after(lifetime_s: float) -> float:
        """MiB still resident after an offer of every page with this lifetime, its expiry (if
        any) and one more (tiny) offer, which is when the server drops what expired."""
        before = _rss_mib()
        endpoint.offer(kv, pages, jnp.asarray, lifetime_s=lifetime_s)
        time.sleep(1.5)
        endpoint.offer(kv, [0], jnp.asarray, lifetime_s=0.1)
        time.sleep(0.5)
        gc.collect()
        return _rss_mib() - before

    assert held_after(60.0) > 150  # unpulled and unexpired: the server keeps the copy
    assert held_after(0.5) < 50  # expired: dropped (from a 200 MiB copy)
