"""The host KV tier's index (`--kv-offload-gib`): which host page holds which prefix-cache key, and
the step's moves between the tiers. Host pages are free, cached (in an LRU of demotion order), or
reserved (promoted this step: not reused until the next drain, so no demotion of the same step
overwrites one before its promotion has read it). The device side of the tiers is
runner/host_tier.py; the page allocator decides when a page moves."""

from __future__ import annotations

import collections
import dataclasses


@dataclasses.dataclass
class Transfers:
    """A step's page moves between the tiers, in the order the device must do them."""

    demotions: list[tuple[int, int]] = dataclasses.field(default_factory=list)   # (device page, host page)
    promotions: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (host page, device page)


class HostTierIndex:
    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self._free: collections.deque[int] = collections.deque(range(num_pages))
        self._key: dict[int, bytes] = {}      # cached host page -> its key
        self._cached: dict[bytes, int] = {}   # key -> host page
        self._lru: collections.OrderedDict[int, None] = collections.OrderedDict()  # oldest first
        self._reserved: list[int] = []
        self._transfers = Transfers()
        self.num_demotions = 0
        self.num_promotions = 0

    @property
    def num_used(self) -> int:
        return len(self._lru) + len(self._reserved)

    def lookup(self, key: bytes) -> int | None:
        return self._cached.get(key)

    def key_of(self, host: int) -> bytes:
        return self._key[host]

    def holds(self, host: int) -> bool:
        return host in self._key

    def demote(self, page: int, key: bytes) -> None:
        """Keeps an evicted device page's K/V under its key (dropping the least recently demoted
        host page when none is free)."""
        if key in self._cached:
            return
        if self._free:
            host = self._free.popleft()
        elif self._lru:
            host, _ = self._lru.popitem(last=False)
            del self._cached[self._key.pop(host)]
        else:
            return  # every host page is being promoted this step
        self._key[host] = key
        self._cached[key] = host
        self._lru[host] = None
        self._transfers.demotions.append((page, host))
        self.num_demotions += 1

    def reserve(self, host: int) -> bytes:
        """Takes a cached host page out of the cache for its promotion this step (before the device
        page it goes to is chosen: choosing one may demote another page, which must not land here);
        returns its key."""
        key = self._key.pop(host)
        del self._cached[key], self._lru[host]
        self._reserved.append(host)
        return key

    def promoted(self, host: int, page: int) -> None:
        """Records the reserved host page's move into device `page` before the step."""
        self._transfers.promotions.append((host, page))
        self.num_promotions += 1

    def reset(self) -> None:
        while self._lru:
            host, _ = self._lru.popitem(last=False)
            del self._cached[self._key.pop(host)]
            self._free.append(host)

    def drain(self) -> Transfers:
        """The moves since the last drain; the host pages promoted since become free again."""
        out, self._transfers = self._transfers, Transfers()
        self._free.extend(self._reserved)
        self._reserved = []
        return out

    def check_invariants(self) -> None:
        free, reserved = set(self._free), set(self._reserved)
        assert len(free) == len(self._free) and len(reserved) == len(self._reserved)
        for host in range(self.num_pages):
            states = [host in free, host in self._lru, host in reserved]
            assert sum(states) == 1, f"host page {host} is in {sum(states)} states (free, cached, reserved)"
            assert (host in self._key) == (host in self._lru), f"host page {host}: key vs LRU"
        for key, host in self._cached.items():
            assert self._key.get(host) == key, f"host cache entry for page {host} disagrees"
        assert len(self._cached) == len(self._key)
