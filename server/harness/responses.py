"""Responses kept for `previous_response_id` (OpenAI's Responses API): the conversation a response
ended, in chat terms, so a request that names it continues it with no history of its own.

Kept for a bounded time and number (oldest first out), and only for the API key that created it:
another caller is told it does not exist, as a missing one is. A continued conversation renders
its earlier turns through the turn cache like any other, so they are spliced as their exact ids.
"""

from __future__ import annotations

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
    at: float


class ResponseStore:
    def __init__(self, ttl: float, capacity: int = 10_000, clock: Callable[[], float] = time.time):
        self.ttl, self.capacity, self.clock = ttl, capacity, clock
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, response_id: str, owner: str, model: str, messages: list[dict[str, Any]]) -> None:
        with self._lock:
            self._items[response_id] = StoredResponse(owner, model, tuple(messages), self.clock())
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)

    def get(self, response_id: str, owner: str) -> StoredResponse | None:
        with self._lock:
            now = self.clock()
            while self._items and now - next(iter(self._items.values())).at > self.ttl:
                self._items.popitem(last=False)
            found = self._items.get(response_id)
        return found if found is not None and found.owner == owner else None
