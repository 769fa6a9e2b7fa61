"""Which replica serves a request: prefix-cache affinity, unless that would unbalance the load.

The router does not tokenize. A request's routing key is its prompt text (chat: the messages as
JSON), cut into PREFIX_BLOCK_CHARS-character blocks; each block boundary's prefix has a chained
hash, remembered (LRU-bounded) with the replica that last served it. A request goes to the replica
that holds its longest remembered prefix, where the KV pages of that prefix most likely still sit
in its prefix cache, unless that replica's load (requests the router has sent it that are not
finished: its waiting + running) exceeds the least-loaded replica's by more than
`balance_slack` (absolute) and `balance_ratio` (relative); then, and for a request with no
remembered prefix, the least-loaded replica serves it (ties: round robin).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import threading

PREFIX_BLOCK_CHARS = 64
MAX_PREFIX_BLOCKS = 256        # the first 16 K characters decide
MAX_REMEMBERED_PREFIXES = 200_000


def prefix_hashes(key: str) -> list[bytes]:
    """Chained hashes of the key's prefixes at every block boundary, shortest first (a final partial
    block counts only when the key is shorter than one block)."""
    n = min(len(key) // PREFIX_BLOCK_CHARS, MAX_PREFIX_BLOCKS) or (1 if key else 0)
    out, h = [], b""
    for i in range(n):
        block = key[i * PREFIX_BLOCK_CHARS:(i + 1) * PREFIX_BLOCK_CHARS]
        h = hashlib.blake2b(h + block.encode("utf-8", "surrogatepass"), digest_size=16).digest()
        out.append(h)
    return out


@dataclasses.dataclass
class ReplicaLoad:
    in_flight: int = 0      # sent and not finished
    routed: int = 0         # requests sent, ever
    by_prefix: int = 0      # of those, sent for their remembered prefix


class RoutingPolicy:
    """Thread-safe: `choose` when a request arrives, `done` when its response has ended."""

    def __init__(self, num_replicas: int, balance_slack: int = 8, balance_ratio: float = 1.5) -> None:
        if num_replicas < 1:
            raise ValueError(f"need at least one replica, got {num_replicas}")
        self.loads = [ReplicaLoad() for _ in range(num_replicas)]
        self.balance_slack = balance_slack
        self.balance_ratio = balance_ratio
        self._prefixes: collections.OrderedDict[bytes, int] = collections.OrderedDict()
        self._next = 0  # round-robin among equally loaded replicas
        self._lock = threading.Lock()

    def choose(self, key: str, healthy: list[bool] | None = None) -> int:
        """The replica for a request with routing key `key`; counts it as in flight there.
        healthy: replicas that may be chosen (default: all)."""
        ok = [i for i in range(len(self.loads)) if healthy is None or healthy[i]]
        if not ok:
            raise RuntimeError("no replica is healthy")
        hashes = prefix_hashes(key)
        with self._lock:
            least = min(ok, key=lambda i: (self.loads[i].in_flight, (i - self._next) % len(self.loads)))
            holder = None
            for h in reversed(hashes):
                r = self._prefixes.get(h)
                if r is not None and r in ok:
                    holder = r
                    break
            chosen = least
            if holder is not None and not self._unbalanced(holder, least):
                chosen = holder
                self.loads[chosen].by_prefix += 1
            elif holder is None:
                self._next = (least + 1) % len(self.loads)
            for h in hashes:
                self._prefixes[h] = chosen
                self._prefixes.move_to_end(h)
            while len(self._prefixes) > MAX_REMEMBERED_PREFIXES:
                self._prefixes.popitem(last=False)
            self.loads[chosen].in_flight += 1
            self.loads[chosen].routed += 1
            return chosen

    def _unbalanced(self, holder: int, least: int) -> bool:
        busy, idle = self.loads[holder].in_flight, self.loads[least].in_flight
        return busy - idle > self.balance_slack and busy > self.balance_ratio * idle

    def done(self, replica: int) -> None:
        with self._lock:
            self.loads[replica].in_flight -= 1
