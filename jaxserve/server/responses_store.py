"""The Responses API's in-memory store (`--enable-response-store`): `store: true` responses by id,
for `GET /v1/responses/{id}` and for `previous_response_id` to continue from.

Bounded twice, by count and by bytes (a response's JSON plus the conversation kept for its
continuation), oldest evicted first: a server that stores every response must not grow without
end. Nothing survives a restart. Reads and writes come from the event loop and from the parsing
worker thread, hence the lock.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import threading

DEFAULT_MAX_RESPONSES = 1024
DEFAULT_MAX_BYTES = 64 * 1024 ** 2


@dataclasses.dataclass(frozen=True)
class StoredResponse:
    response: dict         # the response object as it was answered
    history: list[dict]    # the chat messages it answered (without instructions) + its output as messages
    size: int              # bytes counted against the store's limit


class ResponseStore:
    def __init__(self, max_responses: int = DEFAULT_MAX_RESPONSES, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        if max_responses < 1 or max_bytes < 1:
            raise ValueError("the response store needs room for at least one response")
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self.bytes = 0
        self._items: collections.OrderedDict[str, StoredResponse] = collections.OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, response: dict, history: list[dict]) -> bool:
        """Keeps `response` (evicting the oldest as needed); False when it alone exceeds the byte limit."""
        size = len(json.dumps(response, ensure_ascii=False)) + len(json.dumps(history, ensure_ascii=False))
        if size > self.max_bytes:
            return False
        with self._lock:
            self._drop(response["id"])
            while self._items and (len(self._items) >= self.max_responses or self.bytes + size > self.max_bytes):
                self._drop(next(iter(self._items)))
            self._items[response["id"]] = StoredResponse(response, history, size)
            self.bytes += size
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            return self._items.get(response_id)

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._drop(response_id)

    def _drop(self, response_id: str) -> bool:
        item = self._items.pop(response_id, None)
        if item is None:
            return False
        self.bytes -= item.size
        return True
