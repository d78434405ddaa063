"""Responses kept for `previous_response_id`, retrieval, deletion and their input items (OpenAI's
Responses API): the body a response answered with, the request's own input as items, and the
conversation it ended, in chat terms, so a request that names it continues it with no history of
its own.

Kept for a bounded time, number and size (oldest first out: a response carries its token ids and
logprobs, so a count alone would let long agent transcripts hold gigabytes), and only for the API
key that created it: another caller is told it does not exist, as a missing one is. A continued
conversation renders its earlier turns through the turn cache like any other, so they are spliced
as their exact ids.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class StoredResponse:
    owner: str
    model: str
    messages: tuple[dict[str, Any], ...]  # the input conversation (without instructions) and the output turn
    body: bytes  # the response as it was answered (JSON)
    input_items: tuple[dict[str, Any], ...]  # the request's own input, as Responses items with ids
    at: float
    size: int  # bytes held, counted against the store's bound


class ResponseStore:
    def __init__(self, ttl: float, capacity: int = 10_000, max_bytes: int = 256 * 2**20,
                 clock: Callable[[], float] = time.time):
        self.ttl, self.capacity, self.max_bytes, self.clock = ttl, capacity, max_bytes, clock
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def put(self, response_id: str, owner: str, model: str, messages: list[dict[str, Any]],
            body: dict[str, Any], input_items: list[dict[str, Any]]) -> None:
        encoded = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
        size = len(encoded) + len(json.dumps([messages, input_items], ensure_ascii=False))
        kept = StoredResponse(owner, model, tuple(messages), encoded, tuple(input_items), self.clock(), size)
        with self._lock:
            self._drop(response_id)
            self._items[response_id] = kept
            self._bytes += size
            while len(self._items) > self.capacity or (self._bytes > self.max_bytes and len(self._items) > 1):
                self._drop(next(iter(self._items)))

    def get(self, response_id: str, owner: str) -> StoredResponse | None:
        with self._lock:
            now = self.clock()
            while self._items and now - next(iter(self._items.values())).at > self.ttl:
                self._drop(next(iter(self._items)))
            found = self._items.get(response_id)
        return found if found is not None and found.owner == owner else None

    def delete(self, response_id: str, owner: str) -> bool:
        """Whether `owner`'s response was kept (and now is not)."""
        if self.get(response_id, owner) is None:
            return False
        with self._lock:
            return self._drop(response_id)

    def _drop(self, response_id: str) -> bool:
        gone = self._items.pop(response_id, None)
        if gone is not None:
            self._bytes -= gone.size
        return gone is not None
